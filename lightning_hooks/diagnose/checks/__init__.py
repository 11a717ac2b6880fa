"""The health checks that judge one logging step's statistics alone, each returning the :class:`Evidence` it saw, one
module per family: output units, gradients, optimizer steps, the batch, NaN/Inf, and runs that do not learn at all."""

from lightning_hooks.diagnose.checks.gradients import (
    FADING,
    carried,
    clipped_away,
    depth_trend,
    giant_steps,
    gradient_spread,
    mean_gradients,
    scaled_down,
    vanishing_layers,
)
from lightning_hooks.diagnose.checks.inputs import (
    MIN_LABELS,
    absent_inputs,
    input_scale,
    one_class,
    oversized_start,
    sorted_batches,
)
from lightning_hooks.diagnose.checks.nonfinite import nonfinite
from lightning_hooks.diagnose.checks.snapshot import (
    CONVERGED,
    SETTLED,
    SHOWN_LAYERS,
    Evidence,
    Snapshot,
    Thresholds,
)
from lightning_hooks.diagnose.checks.stalls import STEPLESS, cut_off, no_backward, no_learning, stepless, zero_loss
from lightning_hooks.diagnose.checks.units import (
    SATURATED,
    copied_units,
    dead_units,
    fed_by,
    saturated_layers,
    saturation,
    silent_units,
)
from lightning_hooks.diagnose.checks.updates import FADED, decayed_away, rounded_away, unoptimized, update_ratio

__all__ = [
    "CONVERGED",
    "FADED",
    "FADING",
    "SATURATED",
    "SETTLED",
    "SHOWN_LAYERS",
    "STEPLESS",
    "Evidence",
    "Snapshot",
    "Thresholds",
    "absent_inputs",
    "carried",
    "clipped_away",
    "copied_units",
    "cut_off",
    "dead_units",
    "decayed_away",
    "depth_trend",
    "fed_by",
    "giant_steps",
    "gradient_spread",
    "input_scale",
    "mean_gradients",
    "no_backward",
    "no_learning",
    "nonfinite",
    "MIN_LABELS",
    "one_class",
    "oversized_start",
    "rounded_away",
    "saturated_layers",
    "saturation",
    "scaled_down",
    "silent_units",
    "sorted_batches",
    "stepless",
    "unoptimized",
    "update_ratio",
    "vanishing_layers",
    "zero_loss",
]

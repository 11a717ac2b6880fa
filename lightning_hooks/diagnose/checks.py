"""The health checks that judge one logging step's statistics alone (pure Python).

Each takes a :class:`Snapshot` and the :class:`Thresholds` and returns the :class:`Evidence` it
saw; :class:`~lightning_hooks.diagnose.health.HealthTracker` turns evidence into findings.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_hooks.core.select import label
from lightning_hooks.stats.state import State

__all__ = [
    "Evidence",
    "SHOWN_LAYERS",
    "Snapshot",
    "Thresholds",
    "dead_units",
    "gradient_spread",
    "nonfinite",
    "update_ratio",
]

MIN_SAMPLES = 8
"""``dead_units`` judges a layer only when each of its units saw at least this many values."""
SHOWN_LAYERS = 3
"""How many layers a finding over several names (worst first)."""


@dataclass(frozen=True)
class Thresholds:
    """The lines the checks draw (``HealthMonitor``'s arguments of the same names)."""

    dead_fraction: float = 0.25
    gradient_spread: float = 1e3
    norm_growth: float = 100.0
    update_ratio_low: float = 1e-6
    update_ratio_high: float = 0.1
    activation_growth: float = 1e3
    spike_threshold: float = 20.0
    patience: int = 3


@dataclass
class Snapshot:
    """One logging step's statistics on the host, per layer (qualified names; ``""`` is the model).

    ``order`` is the model's module order; ``activations`` and ``units`` (each output unit's sum
    of squares: zero for a unit that was zero for every sample) are of leaf modules; ``grads``
    pools each layer's parameter gradients; ``ratios`` is ``||Δw|| / ||w||`` per layer with
    ``weights`` its ``||w||``; ``losses`` and ``norms`` are the steps since the previous snapshot,
    each with its loss and the gradient norm of each parameter, ``norm_layers`` naming the layer
    of each.
    """

    step: int
    order: Sequence[str]
    activations: dict[str, State] = field(default_factory=dict)
    units: dict[str, list[float]] = field(default_factory=dict)
    grads: dict[str, State] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    losses: list[tuple[int, float]] = field(default_factory=list)
    norms: list[list[float]] = field(default_factory=list)
    norm_layers: Sequence[str] = ()
    leaves_with_params: frozenset[str] = frozenset()
    guard: tuple[str, int, str] | None = None
    """What a ``NonFiniteGuard`` in the same Trainer found last: ``(layer, step, first line of its report)``."""


@dataclass(frozen=True)
class Evidence:
    """What one check saw at one step, before it became (or extended) a finding."""

    check: str
    layers: tuple[str, ...]
    value: float
    threshold: float
    message: str
    step: int | None = None
    """The step it belongs to when not the snapshot's (a loss spike between logging steps)."""


def dead_units(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers with at least ``dead_fraction`` of their output units zero for every sample of the batch.

    Units are counted in parameter-free leaves; one right after a dead one (a pooling after a dead
    ReLU) carries the same dead units on and is not named again; a layer with weights ends the chain.
    """
    found: list[Evidence] = []
    previous_dead = False
    for name in snap.order:
        counts = snap.units.get(name)
        act = snap.activations.get(name)
        if name in snap.leaves_with_params:
            previous_dead = False
        if counts is None or act is None or not counts:
            continue
        samples = act.numel / len(counts)
        dead = sum(1 for c in counts if c == 0)
        share = dead / len(counts)
        is_dead = samples >= MIN_SAMPLES and share >= limits.dead_fraction
        if is_dead and not previous_dead:
            said = (
                f"{dead} of {len(counts)} output units of `{label(name)}` are zero for every sample of the batch "
                f"({share:.0%}): they pass no gradient back; try a lower learning rate, LeakyReLU or GELU, or a "
                f"normalization layer before the activation."
            )
            found.append(Evidence("dead_units", (label(name),), share, limits.dead_fraction, said))
        previous_dead = is_dead
    return found


def gradient_spread(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers whose mean ``|gradient|`` is ``gradient_spread`` times below or above the median layer's.

    Of the low and the high layers, only those before the first layer of the other kind (nearer
    the input) are named: small gradients that follow exploding ones are not vanishing, and the
    other way round.
    """
    means = {
        name: state.abs_sum / state.numel
        for name in snap.order
        if (state := snap.grads.get(name)) is not None
        and state.numel
        and state.abs_sum > 0
        and math.isfinite(state.abs_sum)
    }
    if len(means) < 3:
        return []
    median = statistics.median(means.values())
    position = {name: i for i, name in enumerate(snap.order)}
    low = [n for n, m in means.items() if m <= median / limits.gradient_spread]
    high = [n for n, m in means.items() if m >= median * limits.gradient_spread]
    first_low = min((position[n] for n in low), default=math.inf)
    first_high = min((position[n] for n in high), default=math.inf)
    low = [n for n in low if position[n] < first_high]
    high = [n for n in high if position[n] < first_low]
    found = []
    for name in sorted(low, key=lambda n: means[n]):
        ratio = means[name] / median
        said = (
            f"the gradient of `{label(name)}` is {ratio:.1e} times the median layer's (mean |g| "
            f"{means[name]:.2e} per element): its weights barely learn; try residual connections, normalization "
            f"layers, ReLU/GELU instead of sigmoid or tanh, or a better initialisation."
        )
        found.append(Evidence("vanishing_gradients", (label(name),), ratio, 1 / limits.gradient_spread, said))
    for name in sorted(high, key=lambda n: -means[n]):
        ratio = means[name] / median
        said = (
            f"the gradient of `{label(name)}` is {ratio:.1e} times the median layer's (mean |g| "
            f"{means[name]:.2e} per element); try gradient clipping (`gradient_clip_val`, `GradClamp`), a lower "
            f"learning rate or warm-up."
        )
        found.append(Evidence("exploding_gradients", (label(name),), ratio, limits.gradient_spread, said))
    return found


def update_ratio(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers whose ``||Δw|| / ||w||`` lies outside ``[update_ratio_low, update_ratio_high]``.

    Step 0 and layers whose ``||w||`` is below 1e-6 (zero-initialised) are not judged.
    """
    if snap.step == 0:
        return []
    found = []
    for name in snap.order:
        ratio = snap.ratios.get(name)
        if ratio is None or not math.isfinite(ratio) or not snap.weights.get(name, 0.0) >= 1e-6:
            continue
        if ratio > limits.update_ratio_high:
            threshold = limits.update_ratio_high
            said = (
                f"by {ratio:.1e} of their norm (healthy: about 1e-3 to 1e-2): the learning rate is too high for it; "
                f"lower it (its parameter group's), or add warm-up."
            )
        elif ratio < limits.update_ratio_low:
            threshold = limits.update_ratio_low
            said = (
                f"by only {ratio:.1e} of their norm (healthy: about 1e-3 to 1e-2): it barely learns; raise the "
                f"learning rate, or look for a vanishing gradient."
            )
        else:
            continue
        said = f"each optimizer step changes the weights of `{label(name)}` {said}"
        found.append(Evidence("update_ratio", (label(name),), ratio, threshold, said))
    return found


def nonfinite(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """NaN/Inf in a layer's output (the first in model order), else in a parameter gradient, or in a step's loss.

    A ``NonFiniteGuard`` finding in the same Trainer (``snap.guard``) is named first.
    """
    bad_losses = [step for step, loss in snap.losses if not math.isfinite(loss)]
    layers: list[str] = []
    for what, table in (("output", snap.activations), ("parameter gradient", snap.grads)):
        layers = [name for name in snap.order if name in table and table[name].nonfinite > 0]
        if layers:
            count = float(len(layers))
            said = (
                f"the {what} of `{label(layers[0])}` holds NaN/Inf values (the first in model order of {len(layers)})"
            )
            break
    else:
        if not bad_losses and snap.guard is None:
            return []
        count = float(len(bad_losses))
        said = (
            f"the training loss was NaN/Inf at {len(bad_losses)} step(s) from step {bad_losses[0]}"
            if bad_losses
            else "a layer made NaN/Inf values"
        )
    named = [label(n) for n in layers]
    note = ""
    if snap.guard is not None:
        layer, step, line = snap.guard
        named = [layer, *(n for n in named if n != layer)]
        note = f" `NonFiniteGuard` found at step {step}: {line}."
    first = min([*bad_losses, *([snap.guard[1]] if snap.guard else [])], default=None)
    said += (
        "; add `NonFiniteGuard()` to name the operation that made them, and look for a division by zero, a log or "
        f"sqrt of a non-positive number, or an overflow.{note}"
    )
    return [Evidence("nonfinite", tuple(named[:SHOWN_LAYERS]) or ("root",), count, 0.0, said, step=first)]

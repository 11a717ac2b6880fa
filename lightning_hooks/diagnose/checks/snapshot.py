"""What the checks read and what they give: one logging step's statistics (:class:`Snapshot`), the lines they
draw (:class:`Thresholds`) and what each saw (:class:`Evidence`)."""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from lightning_hooks.core.select import label
from lightning_hooks.stats.state import State

__all__ = [
    "SHOWN_LAYERS",
    "SETTLED",
    "Thresholds",
    "Snapshot",
    "Evidence",
    "role",
    "peer_medians",
    "listed",
    "reached",
    "CONVERGED",
]

SHOWN_LAYERS = 3
"""How many layers a finding over several names (worst first)."""


SETTLED = 10
"""The optimizer step from which a run counts as past its first steps (references for growth are taken there)."""


@dataclass(frozen=True)
class Thresholds:
    """The lines the checks draw (``HealthMonitor``'s arguments of the same names)."""

    dead_fraction: float = 0.7
    gradient_spread: float = 1e3
    norm_growth: float = 100.0
    update_ratio_low: float = 1e-6
    update_ratio_high: float = 0.1
    activation_growth: float = 1e3
    spike_threshold: float = 20.0
    patience: int = 3


@dataclass
class Snapshot:
    """One logging step's statistics on the host, per layer (qualified names; ``""`` is the model)."""

    step: int
    order: Sequence[str]  # the model's module order
    activations: dict[str, State] = field(default_factory=dict)  # of leaf modules
    units: dict[str, list[float]] = field(default_factory=dict)  # per output unit, its sum of squares (0: dead)
    activated: dict[str, str] = field(default_factory=dict)  # layers whose units are counted after the functional
    # operations (``F.relu``) that took their output to the next layer: those operations
    shared: dict[str, str] = field(default_factory=dict)  # layers whose units are counted after a module without
    # weights that took their output and other layers' too (a ResNet block's one ReLU): that module
    grads: dict[str, State] = field(default_factory=dict)  # each layer's parameter gradients pooled
    ratios: dict[str, float] = field(default_factory=dict)  # ||Δw|| / ||w|| per layer
    weights: dict[str, float] = field(default_factory=dict)  # ||w|| per layer
    changed: dict[str, float] = field(default_factory=dict)  # per half-precision layer, the share of weights stepped
    half: dict[str, tuple[str, float]] = field(default_factory=dict)  # per half-precision layer, its dtype and eps
    eps_lost: frozenset[str] = frozenset()  # half-precision layers whose optimizer's eps rounds to 0 in their dtype
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of each step since the last snapshot
    norms: list[list[float]] = field(default_factory=list)  # of those steps, each parameter's gradient norm
    norm_layers: Sequence[str] = ()  # the layer of each of those parameters
    unoptimized: frozenset[str] = frozenset()  # layers with a gradient that no optimizer steps (nor zeroes)
    carried: Sequence[str] = ()  # layers whose `.grad` nothing zeroes between optimizer steps (manual optimization)
    ungraded: dict[str, tuple[float, ...]] = field(default_factory=dict)  # leaves that ran, stepped with no gradient:
    # a fingerprint of their weights
    total_steps: float = math.inf  # the optimizer steps the fit will take (``Trainer.estimated_stepping_batches``)
    leaves_with_params: frozenset[str] = frozenset()
    guard: tuple[str, int, str] | None = None  # a NonFiniteGuard's last finding: layer, step, first line
    executed: Sequence[str] = ()  # the leaves in the order they first ran (``order`` starts with them)
    last_calls: dict[str, int] = field(default_factory=dict)  # per leaf that ran, when it ran last (a call count)
    output_width: int = 0  # the last dimension of the last leaf's output (a classifier's classes)
    adaptive: frozenset[str] = frozenset()  # layers an adaptive optimizer (anything but SGD) updates
    weight_sizes: dict[str, int] = field(default_factory=dict)  # parameter values per layer of ``weights``
    inputs: dict[str, float] = field(default_factory=dict)  # per batch tensor but masks (path), finite non-zeros' RMS
    saturated: dict[str, float] = field(default_factory=dict)  # per sigmoid/tanh/softmax: share at the bounds
    squashing: dict[str, str] = field(default_factory=dict)  # per sigmoid, tanh, softmax and ReLU layer: which
    row_sums: dict[str, float] = field(default_factory=dict)  # the output layer's gradient: Σ |row sums| / Σ |g|
    sigmoid_misfit: dict[str, float] = field(default_factory=dict)  # and its share a loss's own sigmoid leaves out
    clamped: dict[str, float] = field(default_factory=dict)  # a ReLU output layer: its gradient's share that pushes
    # outputs held at zero below it
    lrs: dict[str, float] = field(default_factory=dict)  # per layer, its group's learning rate (NaN: the optimizer's)
    eps: dict[str, float] = field(default_factory=dict)  # per layer, its adaptive optimizer's eps (where it has one)
    decay: dict[str, tuple[float, float]] = field(default_factory=dict)  # per layer with a weight decay: its value,
    # and the share of every weight it removes each optimizer step (NaN where an adaptive optimizer scales it)
    embeddings: frozenset[str] = frozenset()  # embedding tables (a batch reaches a few of their rows)
    gradless: bool = False  # the optimizer stepped with no gradient on any watched parameter
    backward: bool = True  # a backward ran in the logging step (``training_step`` returned a loss)
    backwards: int = 1  # backward passes since the previous logging step, its own included
    automatic: bool = True  # Lightning's automatic optimization (else the user calls backward and step)
    clip: tuple[str, float] | None = None  # Lightning's gradient clipping: its algorithm (norm, value) and value
    stepwise: bool = False  # a learning-rate scheduler Lightning steps every optimizer step (`"interval": "step"`)
    skipped_at_scale: float | None = None  # a GradScaler skipped the step, its gradients overflowing: its new scale
    pruned: dict[str, list[bool]] = field(default_factory=dict)  # per pruned layer, the output units it pruned away
    channelwise: frozenset[str] = frozenset()  # layers that keep each channel apart (batch norm)
    input_takers: dict[str, str] = field(default_factory=dict)  # per batch tensor (path), the first layer taking it
    taken: dict[str, float] = field(default_factory=dict)  # per batch tensor (path), the RMS of what its taker took
    entry: tuple[str, float] | None = None  # the first layer to take a floating-point tensor, and that tensor's RMS
    normalizers: frozenset[str] = frozenset()  # normalization layers (batch, layer, group, instance, RMS)
    labels: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # the batch's class labels (its
    # last tensor, integers): their count, sum and sum of squares
    batch_index: int = -1  # the batch's index in its epoch (the loader's order)


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
    group: str | None = None
    """Names the finding it makes or extends when that is not its check and layers: one finding over layers that come
    and go (the layers saturated at each logging step)."""


@functools.cache  # a model's layer names, asked at every logging step
def role(name: str) -> str:
    """A layer's role: its name with block indices starred (``h.3.attn.q`` -> ``h.*.attn.q``)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def peer_medians(values: dict[str, float]) -> dict[str, float]:
    """Per layer, the median of ``values`` over the layers of its role (at least three), else over all."""
    roles: dict[str, list[float]] = {}
    for name, value in values.items():
        roles.setdefault(role(name), []).append(value)
    overall = statistics.median(values.values())
    return {n: statistics.median(roles[role(n)]) if len(roles[role(n)]) >= 3 else overall for n in values}


def listed(layers: Sequence[str]) -> str:
    """The first :data:`SHOWN_LAYERS` of ``layers``, labelled, each in backticks, and how many others ("and 2 more")."""
    more = len(layers) - SHOWN_LAYERS
    return ", ".join(f"`{label(name)}`" for name in layers[:SHOWN_LAYERS]) + (f" and {more} more" if more > 0 else "")


def reached(snap: Snapshot, layers: Iterable[str], learns: Callable[[str], bool]) -> dict[str, bool]:
    """Per layer of ``layers`` (in model order), whether one before it ``learns``, embedding tables aside (a batch
    reaches few of their rows): a gradient that got that far back was not lost on its way to the layer."""
    found, learnt = {}, False
    for name in layers:
        found[name] = learnt
        learnt = learnt or (name not in snap.embeddings and learns(name))
    return found


CONVERGED = 1e3
"""A run whose loss fell this many times below its first logging step's has fit its data: its steps may be tiny."""

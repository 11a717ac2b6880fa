"""Health checks over a logging step's statistics: what is wrong, in which layer, since when (pure Python).

The callback (:class:`~lightning_hooks.callbacks.HealthMonitor`) fetches the step's pooled
statistics once and hands them over as a :class:`Snapshot`; :class:`HealthTracker` applies every
check and keeps one :class:`HealthFinding` per check and layers, whose ``last_step`` advances while
it keeps holding. Rendering is in :mod:`lightning_hooks._health_report`.

The thresholds and where they come from (README, "HealthMonitor"):

* ``dead_units``: a unit (channel of a conv map, feature of a linear output) is dead when it is
  exactly zero for every sample of the batch; a layer is named when at least ``dead_fraction``
  (25 %) of its units are dead on ``patience`` consecutive logging steps. A healthy ReLU outputs
  zero for about half of its inputs but almost never for a whole batch.
* ``vanishing_gradients`` / ``exploding_gradients``: a layer's mean ``|gradient|`` per element
  below ``1 / gradient_spread`` (1e-3) or above ``gradient_spread`` (1e3) times the median layer's
  on ``patience`` logging steps (the README's rule of thumb: healthy layers lie within one or two
  orders of magnitude); or the total gradient norm rising at each of ``patience`` logging steps in
  a row and by ``norm_growth`` (100×) over them.
* ``update_ratio``: ``||Δw|| / ||w||`` of a layer's parameters outside ``[update_ratio_low,
  update_ratio_high]`` (1e-6, 0.3) on ``patience`` logging steps; around 1e-3 is the classic rule
  of thumb, small models under Adam run near 1e-2. Step 0 and zero-initialised layers are not judged.
* ``activation_growth``: a layer's output RMS above ``activation_growth`` (1e3) times the median of
  the layers before it (depth), or times its own RMS at the first logging step (time).
* ``nonfinite``: any NaN/Inf in a layer's output or a layer's parameter gradient, or a non-finite loss.
* ``loss_spike``: a step's loss more than ``spike_threshold`` (20) robust standard deviations
  (``1.4826 × MAD``) above the median of the previous ``SPIKE_WINDOW`` steps' losses.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_hooks._select import label
from lightning_hooks._stats import State

CHECKS = (
    "dead_units",
    "vanishing_gradients",
    "exploding_gradients",
    "update_ratio",
    "activation_growth",
    "nonfinite",
    "loss_spike",
)
"""Every check, in the order findings are reported."""

SPIKE_WINDOW = 100
"""How many previous steps' losses the rolling median and MAD of ``loss_spike`` are taken over."""
SPIKE_MIN_HISTORY = 20
"""``loss_spike`` judges no step before this many losses are known."""
MIN_SAMPLES = 8
"""``dead_units`` judges a layer only when each of its units saw at least this many values."""
SHOWN_LAYERS = 3
"""How many layers a finding over several names (worst first)."""
MAD_SCALE = 1.4826
"""``1.4826 × MAD`` estimates the standard deviation of normally distributed values."""


@dataclass(frozen=True)
class HealthFinding:
    """A problem the monitor found: which check, where, since when, the evidence and what to try.

    Attributes:
        check: One of :data:`CHECKS`.
        layers: Qualified module names (``root`` for the LightningModule), worst first.
        step: The optimizer step where it was first seen (``trainer.global_step`` while that batch ran).
        last_step: The latest step where it still held.
        value: The evidence (its meaning depends on the check: a share, a ratio, a count, a z-score).
        threshold: The line ``value`` crossed.
        message: One sentence a user can act on, with the fix to try.
    """

    check: str
    layers: tuple[str, ...]
    step: int
    last_step: int
    value: float
    threshold: float
    message: str


@dataclass(frozen=True)
class Thresholds:
    """The lines the checks draw (see the module docstring for their sources)."""

    dead_fraction: float = 0.25
    gradient_spread: float = 1e3
    norm_growth: float = 100.0
    update_ratio_low: float = 1e-6
    update_ratio_high: float = 0.3
    activation_growth: float = 1e3
    spike_threshold: float = 20.0
    patience: int = 3


@dataclass
class Snapshot:
    """One logging step's statistics on the host, per layer (qualified names; ``""`` is the model).

    ``order`` is the model's module order; ``activations`` and ``units`` (how many values of each
    output unit were non-zero) are of leaf modules; ``grads`` pools each layer's parameter
    gradients; ``ratios`` is ``||Δw|| / ||w||`` per layer with ``weights`` its ``||w||``;
    ``losses`` and ``norms`` are the steps since the previous snapshot, each with its loss and
    the gradient norm of each of ``norm_layers``.
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
    nonfinite_note: str = ""


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


def _names(layers: Sequence[str]) -> str:
    return ", ".join(f"`{label(n)}`" for n in layers)


def _rms(state: State) -> float:
    return math.sqrt(max(state.sum_sq, 0.0) / state.numel) if state.numel else math.nan


def dead_units(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers with at least ``dead_fraction`` of their output units zero for every sample of the batch.

    A parameter-free layer right after a dead one (a pooling, a flatten, a dropout) carries the
    same dead units on and is not named again.
    """
    found: list[Evidence] = []
    previous_dead = False
    for name in snap.order:
        counts = snap.units.get(name)
        act = snap.activations.get(name)
        if counts is None or act is None or not counts:
            continue
        samples = act.numel / len(counts)
        dead = sum(1 for c in counts if c == 0)
        share = dead / len(counts)
        is_dead = samples >= MIN_SAMPLES and share >= limits.dead_fraction
        if is_dead and not (previous_dead and name not in snap.leaves_with_params):
            found.append(
                Evidence(
                    "dead_units",
                    (label(name),),
                    share,
                    limits.dead_fraction,
                    f"{dead} of {len(counts)} output units of `{label(name)}` are zero for every sample of the batch "
                    f"({share:.0%}): they pass no gradient back; try a lower learning rate, LeakyReLU or GELU, or a "
                    f"normalization layer before the activation.",
                )
            )
        previous_dead = is_dead
    return found


def _layer_mean_abs(snap: Snapshot) -> dict[str, float]:
    """Mean ``|gradient|`` per element of each layer with a finite, non-zero gradient."""
    found = {}
    for name in snap.order:
        state = snap.grads.get(name)
        if state is not None and state.numel and state.abs_sum > 0 and math.isfinite(state.abs_sum):
            found[name] = state.abs_sum / state.numel
    return found


def gradient_spread(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers whose mean ``|gradient|`` is ``gradient_spread`` times below or above the median layer's."""
    means = _layer_mean_abs(snap)
    if len(means) < 3:
        return []
    median = statistics.median(means.values())
    found = []
    for name, mean in sorted(means.items(), key=lambda item: item[1]):
        ratio = mean / median
        if ratio <= 1 / limits.gradient_spread:
            found.append(
                Evidence(
                    "vanishing_gradients",
                    (label(name),),
                    ratio,
                    1 / limits.gradient_spread,
                    f"the gradient of `{label(name)}` is {ratio:.1e} times the median layer's (mean |g| {mean:.2e} "
                    f"per element): its weights barely learn; try residual connections, normalization layers, "
                    f"ReLU/GELU instead of sigmoid or tanh, or a better initialisation.",
                )
            )
    for name, mean in sorted(means.items(), key=lambda item: -item[1]):
        ratio = mean / median
        if ratio >= limits.gradient_spread:
            found.append(
                Evidence(
                    "exploding_gradients",
                    (label(name),),
                    ratio,
                    limits.gradient_spread,
                    f"the gradient of `{label(name)}` is {ratio:.1e} times the median layer's (mean |g| {mean:.2e} "
                    f"per element); try gradient clipping (`gradient_clip_val`, `GradClamp`), a lower learning rate "
                    f"or warm-up.",
                )
            )
    return found


def update_ratio(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers whose ``||Δw|| / ||w||`` lies outside ``[update_ratio_low, update_ratio_high]``."""
    if snap.step == 0:  # the first step moves zero-initialised and freshly initialised weights the most
        return []
    found = []
    for name in snap.order:
        ratio, weight = snap.ratios.get(name), snap.weights.get(name, 0.0)
        if ratio is None or not math.isfinite(ratio) or weight < 1e-6:  # zero-initialised: no scale to judge by
            continue
        if ratio > limits.update_ratio_high:
            found.append(
                Evidence(
                    "update_ratio",
                    (label(name),),
                    ratio,
                    limits.update_ratio_high,
                    f"each optimizer step changes the weights of `{label(name)}` by {ratio:.1e} of their norm "
                    f"(healthy: about 1e-3 to 1e-2): the learning rate is too high for it; lower it, or add warm-up.",
                )
            )
        elif ratio < limits.update_ratio_low:
            found.append(
                Evidence(
                    "update_ratio",
                    (label(name),),
                    ratio,
                    limits.update_ratio_low,
                    f"each optimizer step changes the weights of `{label(name)}` by only {ratio:.1e} of their norm "
                    f"(healthy: about 1e-3 to 1e-2): it barely learns; raise the learning rate, or look for a "
                    f"vanishing gradient.",
                )
            )
    return found


def nonfinite(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """The first layer in model order whose output, or else whose parameter gradient, holds NaN/Inf."""
    for what, table in (("output", snap.activations), ("parameter gradient", snap.grads)):
        bad = [name for name in snap.order if name in table and table[name].nonfinite > 0]
        if bad:
            count = table[bad[0]].nonfinite
            note = f" {snap.nonfinite_note}" if snap.nonfinite_note else ""
            return [
                Evidence(
                    "nonfinite",
                    tuple(label(n) for n in bad[:SHOWN_LAYERS]),
                    count,
                    0.0,
                    f"the {what} of `{label(bad[0])}` holds {count:.0f} NaN/Inf values (first in model order of "
                    f"{len(bad)} layer(s)); add `NonFiniteGuard()` to name the operation that made them, and look "
                    f"for a division by zero, a log or sqrt of a non-positive number, or an overflow.{note}",
                )
            ]
    bad_losses = [step for step, loss in snap.losses if not math.isfinite(loss)]
    if bad_losses:
        return [
            Evidence(
                "nonfinite",
                ("root",),
                len(bad_losses),
                0.0,
                f"the training loss was NaN/Inf at {len(bad_losses)} step(s) from step {bad_losses[0]}; add "
                f"`NonFiniteGuard()` to name the layer that made it.",
                step=bad_losses[0],
            )
        ]
    return []


class HealthTracker:
    """Applies the checks to each logging step's :class:`Snapshot` and keeps the findings.

    Evidence that needs persistence (dead units, gradient spread, update ratio, activation
    growth) becomes a finding once it has held on ``patience`` consecutive logging steps, with
    the step it was first seen; a finding already made for the same check and layers only has
    its ``last_step``, ``value`` advanced.

    Example::

        >>> tracker = HealthTracker(["dead_units"], Thresholds(patience=1))
        >>> snap = Snapshot(step=5, order=["relu"], activations={"relu": State(numel=64)}, units={"relu": [0.0] * 4})
        >>> [(f.check, f.layers, f.step, f.value) for f in tracker.update(snap)]
        [('dead_units', ('relu',), 5, 1.0)]
    """

    def __init__(self, checks: Sequence[str], limits: Thresholds) -> None:
        self.checks, self.limits = list(checks), limits
        self.findings: list[HealthFinding] = []
        self._index: dict[tuple[str, tuple[str, ...]], int] = {}
        self._streaks: dict[tuple[str, tuple[str, ...]], tuple[int, int]] = {}
        """Per (check, layers): (first step of the current streak, its length in logging steps)."""
        self._norm_totals: deque[float] = deque(maxlen=limits.patience + 1)
        self._layer_norms: deque[dict[str, float]] = deque(maxlen=limits.patience + 1)
        self._first_rms: dict[str, tuple[float, int]] = {}
        self._losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._loss_norms: deque[list[float]] = deque(maxlen=SPIKE_WINDOW)
        self.affected: dict[str, int] = {}
        """Per check, how many layers the latest snapshot found affected (persistent or not)."""

    def update(self, snap: Snapshot) -> list[HealthFinding]:
        """Apply the checks to ``snap``; the findings that are new (not extensions of earlier ones)."""
        persistent: list[Evidence] = []
        immediate: list[Evidence] = []
        on = set(self.checks)
        if "dead_units" in on:
            persistent += dead_units(snap, self.limits)
        if on & {"vanishing_gradients", "exploding_gradients"}:
            persistent += [e for e in gradient_spread(snap, self.limits) if e.check in on]
        if "exploding_gradients" in on:
            immediate += self._norm_growth(snap)
        if "update_ratio" in on:
            persistent += update_ratio(snap, self.limits)
        if "activation_growth" in on:
            persistent += self._activation_growth(snap)
        if "nonfinite" in on:
            immediate += nonfinite(snap, self.limits)
        if "loss_spike" in on:
            immediate += self._loss_spikes(snap)
        self.affected = {check: 0 for check in self.checks}
        for e in persistent + immediate:
            self.affected[e.check] = self.affected.get(e.check, 0) + len(e.layers)
        new: list[HealthFinding] = []
        held = set()
        for e in persistent:
            key = (e.check, e.layers)
            held.add(key)
            start, length = self._streaks.get(key, (snap.step, 0))
            self._streaks[key] = (start, length + 1)
            if length + 1 >= self.limits.patience:
                new += self._record(e, start, snap.step)
        for key in [k for k in self._streaks if k not in held]:
            del self._streaks[key]
        for e in immediate:
            step = snap.step if e.step is None else e.step
            new += self._record(e, step, step)
        return new

    def _record(self, e: Evidence, first: int, last: int) -> list[HealthFinding]:
        key = (e.check, e.layers)
        index = self._index.get(key)
        if index is not None:
            self.findings[index] = replace(self.findings[index], last_step=last, value=e.value, message=e.message)
            return []
        finding = HealthFinding(e.check, e.layers, first, last, e.value, e.threshold, e.message)
        self._index[key] = len(self.findings)
        self.findings.append(finding)
        return [finding]

    def _norm_growth(self, snap: Snapshot) -> list[Evidence]:
        """The total gradient norm rising at each of ``patience`` logging steps, by ``norm_growth`` overall."""
        if not snap.grads:
            return []
        total = math.sqrt(math.fsum(max(s.sum_sq, 0.0) for s in snap.grads.values()))
        norms = {name: math.sqrt(max(s.sum_sq, 0.0)) for name, s in snap.grads.items()}
        if not math.isfinite(total):
            self._norm_totals.clear()
            self._layer_norms.clear()
            return []
        self._norm_totals.append(total)
        self._layer_norms.append(norms)
        totals = list(self._norm_totals)
        if len(totals) <= self.limits.patience or not all(b > a for a, b in zip(totals, totals[1:], strict=False)):
            return []
        growth = totals[-1] / max(totals[0], 1e-30)
        if growth < self.limits.norm_growth:
            return []
        before = self._layer_norms[0]
        grew = sorted(norms, key=lambda n: -norms[n] / max(before.get(n, 0.0), 1e-30))[:SHOWN_LAYERS]
        return [
            Evidence(
                "exploding_gradients",
                tuple(label(n) for n in grew),
                growth,
                self.limits.norm_growth,
                f"the total gradient norm grew {growth:.0f}-fold over the last {self.limits.patience} logging steps "
                f"(to {total:.3g}), most in {_names(grew)}; try gradient clipping (`gradient_clip_val`), a lower "
                f"learning rate, or a smaller initialisation.",
            )
        ]

    def _activation_growth(self, snap: Snapshot) -> list[Evidence]:
        """Output RMS ``activation_growth`` times that of the layers before it, or of its own first logging step."""
        limit = self.limits.activation_growth
        found = []
        earlier: list[float] = []
        for name in snap.order:
            state = snap.activations.get(name)
            if state is None or not state.numel or state.nonfinite:
                continue
            rms = _rms(state)
            first, since = self._first_rms.setdefault(name, (rms, snap.step))
            base = statistics.median(earlier) if len(earlier) >= 2 else 0.0
            depth = rms / base if base > 0 else 0.0
            time = rms / first if first > 0 else 0.0
            if depth >= limit or time >= limit:
                how = (
                    f"{depth:.0f} times the median of the layers before it"
                    if depth >= time
                    else f"{time:.0f} times what it was at step {since}"
                )
                found.append(
                    Evidence(
                        "activation_growth",
                        (label(name),),
                        max(depth, time),
                        limit,
                        f"the output of `{label(name)}` has an RMS of {rms:.3g}, {how}: the next overflow is on its "
                        f"way; try normalization layers, a smaller initialisation or a lower learning rate.",
                    )
                )
            if rms > 0:
                earlier.append(rms)
        return found

    def _loss_spikes(self, snap: Snapshot) -> list[Evidence]:
        """Each step whose loss lies ``spike_threshold`` robust deviations above the rolling median."""
        found = []
        for i, (step, loss) in enumerate(snap.losses):
            norms = snap.norms[i] if i < len(snap.norms) else []
            if not math.isfinite(loss):
                continue
            if len(self._losses) >= SPIKE_MIN_HISTORY:
                history = list(self._losses)
                median = statistics.median(history)
                mad = statistics.median(abs(x - median) for x in history)
                scale = max(MAD_SCALE * mad, 1e-3 * abs(median), 1e-12)
                z = (loss - median) / scale
                if z > self.limits.spike_threshold:
                    found.append(self._spike(step, loss, median, z, norms, snap.norm_layers))
                    continue  # a spike does not become the level the next steps are judged by
            self._losses.append(loss)
            self._loss_norms.append(norms)
        return found

    def _spike(
        self, step: int, loss: float, median: float, z: float, norms: list[float], layers: Sequence[str]
    ) -> Evidence:
        jumps: dict[str, float] = {}
        for j, name in enumerate(layers):
            past = [row[j] for row in self._loss_norms if j < len(row) and math.isfinite(row[j])]
            if j < len(norms) and past:
                jumps[name] = norms[j] / max(statistics.median(past), 1e-30)
        worst = sorted(jumps, key=lambda n: -jumps[n])[:SHOWN_LAYERS]
        where = (
            f"; the gradient norm jumped most in {_names(worst)} ({jumps[worst[0]]:.3g}× its recent median)"
            if worst
            else ""
        )
        return Evidence(
            "loss_spike",
            tuple(label(n) for n in worst) or ("root",),
            z,
            self.limits.spike_threshold,
            f"the training loss jumped to {loss:.4g} at step {step} (recent median {median:.4g}, {z:.0f} robust "
            f"deviations){where}; look at that batch, lower the learning rate, or clip gradients.",
            step=step,
        )

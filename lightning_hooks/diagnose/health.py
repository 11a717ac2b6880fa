"""Health checks over a logging step's statistics: what is wrong, in which layer, since when (pure Python).

The callback (:class:`~lightning_hooks.callbacks.HealthMonitor`) fetches the step's pooled
statistics once and hands them over as a :class:`Snapshot`; :class:`HealthTracker` applies every
check and keeps one :class:`HealthFinding` per check and layers, whose ``last_step`` advances while
it keeps holding. Rendering is in :mod:`lightning_hooks.diagnose.report`.

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
  update_ratio_high]`` (1e-6, 0.1) on ``patience`` logging steps; around 1e-3 is the classic rule
  of thumb, small models under Adam run near 1e-2. Step 0 and zero-initialised layers are not judged.
* ``activation_growth``: a layer's output RMS above ``activation_growth`` (1e3) times the median of
  the layers before it (depth), or times its own RMS at the first logging step (time).
* ``nonfinite``: any NaN/Inf in a layer's output or a layer's parameter gradient, or a non-finite loss
  (the value: how many layers, or how many steps' losses).
* ``loss_spike``: a step's loss more than ``spike_threshold`` (20) robust standard deviations
  (``1.4826 × MAD``, at least :data:`SPIKE_FLOOR` of the highest median of the fit) above the
  median of the previous ``SPIKE_WINDOW`` steps' losses, as they stood at the previous logging step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from lightning_hooks.core.select import label
from lightning_hooks.stats.state import State

Check = Literal[
    "dead_units",
    "vanishing_gradients",
    "exploding_gradients",
    "update_ratio",
    "activation_growth",
    "nonfinite",
    "loss_spike",
]
"""A check's name (the type of ``HealthMonitor(checks=...)``, which LightningCLI reads)."""

CHECKS: tuple[str, ...] = get_args(Check)
"""Every check, in the order findings are reported."""

SPIKE_WINDOW = 100
"""How many previous steps' losses the rolling median and MAD of ``loss_spike`` are taken over."""
SPIKE_MIN_HISTORY = 20
"""``loss_spike`` judges no step before this many losses are known."""
MIN_SAMPLES = 8
"""``dead_units`` judges a layer only when each of its units saw at least this many values."""
SHOWN_LAYERS = 3
"""How many layers a finding over several names (worst first)."""
SPIKE_FLOOR = 0.05
"""``loss_spike``'s robust deviation is at least this share of the highest rolling median seen in the fit: a
batch at 0.5 when the loss has settled at 0.01 is noise next to where the loss started, not a spike."""
ALIKE = 10.0
"""Layers whose gradient norm jumped within this factor of the largest jump jumped alike."""
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


def _names(layers: Sequence[str]) -> str:
    return ", ".join(f"`{label(n)}`" for n in layers)


def _rms(state: State) -> float:
    return math.sqrt(max(state.sum_sq, 0.0) / state.numel) if state.numel else math.nan


def dead_units(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers with at least ``dead_fraction`` of their output units zero for every sample of the batch.

    Units are counted in parameter-free leaves; one right after a dead one (a pooling, a flatten, a
    dropout after a dead ReLU) carries the same dead units on and is not named again, while a
    layer with weights in between ends the chain.
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
    """Layers whose mean ``|gradient|`` is ``gradient_spread`` times below or above the median layer's.

    When the gradients fall or rise along the depth, some layers sit below and some above the
    median: the end nearer the input names the problem (backward compounds from the output
    towards the input). Small gradients there are vanishing, and the large ones after them are
    not reported as exploding; large gradients there are exploding, and the small ones after
    them are not reported as vanishing.
    """
    means = _layer_mean_abs(snap)
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
        found.append(
            Evidence(
                "vanishing_gradients",
                (label(name),),
                ratio,
                1 / limits.gradient_spread,
                f"the gradient of `{label(name)}` is {ratio:.1e} times the median layer's (mean |g| "
                f"{means[name]:.2e} per element): its weights barely learn; try residual connections, normalization "
                f"layers, ReLU/GELU instead of sigmoid or tanh, or a better initialisation.",
            )
        )
    for name in sorted(high, key=lambda n: -means[n]):
        ratio = means[name] / median
        found.append(
            Evidence(
                "exploding_gradients",
                (label(name),),
                ratio,
                limits.gradient_spread,
                f"the gradient of `{label(name)}` is {ratio:.1e} times the median layer's (mean |g| "
                f"{means[name]:.2e} per element); try gradient clipping (`gradient_clip_val`, `GradClamp`), a lower "
                f"learning rate or warm-up.",
            )
        )
    return found


def update_ratio(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Layers whose ``||Δw|| / ||w||`` lies outside ``[update_ratio_low, update_ratio_high]``."""
    if snap.step == 0:  # the first step moves zero-initialised and freshly initialised weights the most
        return []
    judged = {
        name: ratio
        for name in snap.order
        if (ratio := snap.ratios.get(name)) is not None
        and math.isfinite(ratio)
        and snap.weights.get(name, 0.0) >= 1e-6  # zero-initialised: no scale to judge by
    }
    found = []
    for name, ratio in judged.items():
        if ratio > limits.update_ratio_high:
            found.append(
                Evidence(
                    "update_ratio",
                    (label(name),),
                    ratio,
                    limits.update_ratio_high,
                    f"each optimizer step changes the weights of `{label(name)}` by {ratio:.1e} of their norm "
                    f"(healthy: about 1e-3 to 1e-2): the learning rate is too high for it; lower it (its parameter "
                    f"group's), or add warm-up.",
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
    """NaN/Inf in a layer's output (the first in model order), else in a parameter gradient, or in a step's loss.

    A :class:`NonFiniteGuard` finding in the same Trainer (``snap.guard``) is named first: it saw the
    step where the values were made, before they spread.
    """
    bad_losses = [step for step, loss in snap.losses if not math.isfinite(loss)]
    layers: list[str] = []
    what = ""
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
    return [
        Evidence(
            "nonfinite",
            tuple(named[:SHOWN_LAYERS]) or ("root",),
            count,
            0.0,
            f"{said}; add `NonFiniteGuard()` to name the operation that made them, and look for a division by "
            f"zero, a log or sqrt of a non-positive number, or an overflow.{note}",
            step=first,
        )
    ]


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
        self._step_norms: deque[tuple[int, dict[str, float]]] = deque(maxlen=limits.patience + 1)
        self._logged_norms: deque[tuple[int, dict[str, float]]] = deque(maxlen=limits.patience + 1)
        self._top_median = 0.0
        self._previous_step = -1
        self._last_spike: tuple[int, Evidence] | None = None
        self._first_rms: dict[str, tuple[float, int]] = {}
        self._losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._loss_norms: deque[list[float]] = deque(maxlen=SPIKE_WINDOW)
        self.affected: dict[str, int] = {}
        """Per check, how many layers the findings made or extended by the latest snapshot name."""
        self._touched: set[tuple[str, tuple[str, ...]]] = set()

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
        self._touched = set()
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
            going_on = self._going_on(e) if e.check == "nonfinite" else None
            if going_on is not None:  # NaN spreads: the same finding, wherever it has got to
                e = replace(e, layers=going_on.layers)
            new += self._record(e, step, snap.step if e.check == "nonfinite" else step)
        self._previous_step = snap.step
        layers: dict[str, set[str]] = {check: set() for check in self.checks}
        for check, names in self._touched:
            layers[check].update(names)
        self.affected = {check: len(names) for check, names in layers.items()}
        return new

    def _going_on(self, e: Evidence) -> HealthFinding | None:
        """A finding of ``e``'s check that held at the previous logging step."""
        return next(
            (f for f in self.findings if f.check == e.check and f.last_step == self._previous_step),
            None,
        )

    def _record(self, e: Evidence, first: int, last: int) -> list[HealthFinding]:
        key = (e.check, e.layers)
        self._touched.add(key)
        index = self._index.get(key)
        if index is not None:
            self.findings[index] = replace(self.findings[index], last_step=last, value=e.value, message=e.message)
            return []
        finding = HealthFinding(e.check, e.layers, first, last, e.value, e.threshold, e.message)
        self._index[key] = len(self.findings)
        self.findings.append(finding)
        return [finding]

    def _norm_growth(self, snap: Snapshot) -> list[Evidence]:
        """The total gradient norm growing without bound: rising at each of ``patience`` logging steps in a row
        and ``norm_growth``-fold over them, or rising like that over consecutive steps until it overflowed.

        A logging step's level is the median total of the steps the ring kept since the previous one
        (the logging step's own total without it); a deep net can go from healthy to ``inf`` between
        two logging steps, which the ring sees step by step.
        """
        found: list[Evidence] = []
        steps: list[dict[str, float]] = []
        for (step, _), norms in zip(snap.losses, snap.norms, strict=False):
            if not norms:  # a step whose norms were not taken: the run of consecutive steps is broken
                self._step_norms.clear()
                continue
            layer_norms = _per_layer(norms, snap.norm_layers)
            total = math.sqrt(math.fsum(v * v for v in layer_norms.values()))
            if math.isfinite(total):
                steps.append(layer_norms)
                self._step_norms.append((step, layer_norms))
                continue
            run = list(self._step_norms) + ([(step, layer_norms)] if math.isinf(total) else [])
            self._step_norms.clear()
            found += self._grew(run, "steps in a row, then overflowed", overflowed=True)
        # a logging step's level: each layer's median over the ring's steps (the step's own norms without it)
        level = {n: statistics.median(row[n] for row in steps) for n in steps[0]} if steps else _per_layer_of(snap)
        if level and all(math.isfinite(v) for v in level.values()):
            self._logged_norms.append((snap.step, level))
            found += self._grew(list(self._logged_norms), "logging steps in a row")
        return found[:1]

    def _grew(self, run: list[tuple[int, dict[str, float]]], how: str, overflowed: bool = False) -> list[Evidence]:
        """Evidence when the last ``patience + 1`` totals of ``run`` rise at each step and ``norm_growth``-fold;
        a run that ``overflowed`` needs only its last three (two rises) to."""
        length = 3 if overflowed else self.limits.patience + 1
        run = run[-length:]
        totals = [math.sqrt(math.fsum(v * v for v in norms.values())) for _, norms in run]
        if len(totals) < length or not all(b > a for a, b in zip(totals, totals[1:], strict=False)):
            return []
        growth = totals[-1] / max(totals[0], 1e-30)
        if growth < self.limits.norm_growth:
            return []
        (first_step, before), (last_step, after) = run[0], run[-1]
        self._logged_norms.clear()  # the next finding needs a new run of rising norms
        grew = sorted(after, key=lambda n: -_ratio(after[n], before.get(n, 0.0)))[:SHOWN_LAYERS]
        return [
            Evidence(
                "exploding_gradients",
                tuple(label(n) for n in grew),
                growth,
                self.limits.norm_growth,
                f"the total gradient norm grew {growth:.3g}-fold over {len(totals) - 1} {how} (to {totals[-1]:.3g} "
                f"at step {last_step}), most in {_names(grew)}; try gradient clipping (`gradient_clip_val`), a lower "
                f"learning rate, or a smaller initialisation.",
                step=first_step,
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
        """Each step whose loss lies ``spike_threshold`` robust deviations above the rolling median.

        The steps since the previous logging step are judged against the history as it stood then
        (one median and one MAD per logging step, not per step). A spike on the step right after
        one is the same spike going on: it extends that finding.
        """
        found = []
        level = self._level()
        for i, (step, loss) in enumerate(snap.losses):
            norms = snap.norms[i] if i < len(snap.norms) else []
            if not math.isfinite(loss):
                continue
            if level is not None:
                median, scale = level
                z = (loss - median) / scale
                if z > self.limits.spike_threshold:
                    spike = self._spike(step, loss, median, z, norms, snap.norm_layers)
                    if self._last_spike is not None and self._last_spike[0] == step - 1:
                        spike = replace(spike, layers=self._last_spike[1].layers, step=self._last_spike[1].step)
                    self._last_spike = (step, spike)
                    found.append(spike)
                    continue  # a spike does not become the level the next steps are judged by
            self._losses.append(loss)
            if norms:
                self._loss_norms.append(norms)
        return found

    def _level(self) -> tuple[float, float] | None:
        """The loss history's median and robust deviation (``None`` before :data:`SPIKE_MIN_HISTORY` losses)."""
        if len(self._losses) < SPIKE_MIN_HISTORY:
            return None
        history = list(self._losses)
        median = statistics.median(history)
        self._top_median = max(self._top_median, median)
        mad = statistics.median(abs(x - median) for x in history)
        return median, max(MAD_SCALE * mad, SPIKE_FLOOR * self._top_median, 1e-12)

    def spike_line(self) -> float:
        """Half-way to a spike by the current history: a loss above it may be one (``-inf`` before the history)."""
        level = self._level()
        return -math.inf if level is None else level[0] + 0.5 * self.limits.spike_threshold * level[1]

    def _spike(
        self, step: int, loss: float, median: float, z: float, norms: list[float], layers: Sequence[str]
    ) -> Evidence:
        """A spike at ``step``, named after the layers whose gradient norm jumped most.

        A layer's jump is the smallest of its parameters' (each against its median over the window):
        when a layer's output jumps, the weights of the layer after it see a larger input, but its
        bias sees the same gradient. Of the layers that jumped alike (within :data:`ALIKE` of the
        largest), the one nearest the output comes first: a jump that enters the backward pass at a
        layer is carried on to every layer before it.
        """
        jumps: dict[str, float] = {}
        for j, name in enumerate(layers):
            past = [row[j] for row in self._loss_norms if j < len(row) and math.isfinite(row[j])]
            if j < len(norms) and past:
                jump = _ratio(norms[j], statistics.median(past))
                jumps[name] = min(jumps.get(name, math.inf), jump)
        top = max(jumps.values(), default=0.0)
        alike = [n for n in jumps if jumps[n] >= top / ALIKE and top > 1]
        order = {n: i for i, n in enumerate(dict.fromkeys(layers))}
        worst = sorted(alike, key=lambda n: -order[n])[:SHOWN_LAYERS]
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


def _ratio(new: float, old: float) -> float:
    return new / old if old > 0 else (math.inf if new > 0 else 1.0)


def _per_layer_of(snap: Snapshot) -> dict[str, float]:
    """Each layer's gradient norm in the snapshot."""
    return {name: math.sqrt(max(s.sum_sq, 0.0)) for name, s in snap.grads.items()}


def _per_layer(norms: Sequence[float], layers: Sequence[str]) -> dict[str, float]:
    """Per-parameter norms pooled into their layers' (the 2-norm of the layer's parameters together)."""
    squares: dict[str, float] = {}
    for value, name in zip(norms, layers, strict=False):
        squares[name] = squares.get(name, 0.0) + value * value
    return {name: math.sqrt(v) for name, v in squares.items()}

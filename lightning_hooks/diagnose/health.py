"""Health checks over a logging step's statistics: what is wrong, in which layer, since when (pure Python)."""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import reduce
from typing import Literal, get_args

from lightning_hooks.core.select import label
from lightning_hooks.diagnose.checks import (
    CONVERGED,
    FADED,
    FADING,
    SATURATED,
    SETTLED,
    SHOWN_LAYERS,
    Evidence,
    Snapshot,
    Thresholds,
    absent_inputs,
    carried,
    clipped_away,
    copied_units,
    cut_off,
    dead_units,
    decayed_away,
    fed_by,
    giant_steps,
    gradient_spread,
    input_scale,
    mean_gradients,
    no_backward,
    no_learning,
    nonfinite,
    rounded_away,
    saturated_layers,
    saturation,
    silent_units,
    unoptimized,
    update_ratio,
    vanishing_layers,
    zero_loss,
)
from lightning_hooks.stats.state import State

__all__ = [
    "CHECKS",
    "Check",
    "HealthFinding",
    "HealthTracker",
    "Snapshot",
    "Thresholds",
    "dead_units",
    "gradient_spread",
    "loss_level",
]

Check = Literal[
    "dead_units",
    "vanishing_gradients",
    "exploding_gradients",
    "update_ratio",
    "activation_growth",
    "nonfinite",
    "loss_spike",
    "saturation",
    "input_scale",
    "no_learning",
]
"""A check's name (the type of ``HealthMonitor(checks=...)``, which LightningCLI reads)."""

CHECKS: tuple[str, ...] = get_args(Check)
"""Every check, in the order findings are reported."""

SPIKE_WINDOW = 100
"""How many previous steps' losses the rolling median and MAD of ``loss_spike`` are taken over."""
SPIKE_MIN_HISTORY = 20
"""``loss_spike`` judges no step before this many losses are known."""
SPIKE_FLOOR = 0.05
"""``loss_spike``'s robust deviation is at least this share of the highest rolling median seen in the fit."""
SPIKE_TAIL = 5.0
"""A spike also stands this many times further above the rolling median than the highest loss of its window (from
step :data:`SETTLED` on): batches of one or two samples have losses of hard samples 1,000 times the median every few
dozen steps, up to 3 times further out than the window's highest (digits at batch size 1); a bad batch, 38 times."""
ALIKE = 10.0
"""Layers whose gradient norm jumped within this factor of the largest jump jumped alike."""
JUMPED = 2.0
"""A layer's gradient norm jumped with a loss spike when it reached this many times its recent median."""
MAD_SCALE = 1.4826
"""``1.4826 × MAD`` estimates the standard deviation of normally distributed values."""
MOMENTS = ("loss_spike", "exploding_gradients")
"""Immediate checks whose evidence belongs to one moment (a step, a run of steps), not to the logging step."""
LEARNING = frozenset({"vanishing_gradients", "exploding_gradients", "update_ratio"})
"""The checks that judge how each layer learns, from its gradients and update."""
DEAD_SAMPLES = 512
"""``dead_units`` judges a layer whose units are not all silent over a window of at least this many samples."""
RISE_MAX = 64
"""``exploding_gradients`` follows a steady rise of the gradient norm over at most this many logging steps."""
ZERO_START = 1e-4
"""A layer whose weights' RMS is below this when first seen started at zero by design (LoRA's B, layer scale)."""


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


class HealthTracker:
    """Applies the checks to each logging step's :class:`Snapshot` and keeps the findings.

    Dead units, gradient spread, update ratio and activation growth become a finding once they
    have held on ``patience`` consecutive logging steps, dated to the first; evidence for a finding
    already made (same check and layers, or the same :attr:`Evidence.group`) advances its ``last_step``, ``value``,
    ``message`` and ``layers``.

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
        self._streaks: dict[tuple[str, tuple[str, ...]], tuple[int, int]] = {}  # first step, length in logging steps
        self._step_norms: deque[tuple[int, dict[str, float]]] = deque(maxlen=limits.patience + 1)
        self._logged_norms: deque[tuple[int, dict[str, float]]] = deque(maxlen=RISE_MAX)
        self._top_median = 0.0
        self._previous_step = -1
        self._last_spike: tuple[int, Evidence] | None = None
        self._reference: dict[str, tuple[float, int]] = {}  # per layer, its output RMS once the run settled
        self._reference_loss: float | None = None
        self._first_loss: float | None = None  # the median loss of the first logging step
        self._first_gradient: float | None = None  # and its median layer's mean |gradient|
        self._saturated_early: set[str] = set()  # the layers saturated at a logging step before the run settled
        self._zero_start: set[str] = set()
        self._first_weights: dict[str, tuple[float, float]] = {}  # per layer, its weights' and gradient's norms when
        # first seen
        self._lr_peak: dict[str, float] = {}  # per layer, the highest learning rate of the fit so far
        self._lr_last: dict[str, float] = {}  # and the one at the previous logging step
        self._faded_layers: set[str] = set()  # the layers whose learning rate faded early (see _faded)
        self._ungraded: dict[str, tuple[int, tuple[float, ...]]] = {}  # per layer, since when, and its fingerprint
        self._zero_losses: int | None = 0  # steps from step 0 whose loss was exactly zero, None after any other
        self._backwardless: int | None = None  # since when no backward ran and no gradient came (see _no_backward)
        self._carried: frozenset[str] = frozenset()  # the layers whose `.grad` was found not zeroed between steps
        self._silent: dict[str, deque[tuple[int, list[bool], float]]] = {}  # step, silent units, samples per unit
        self._losses: deque[tuple[int, float]] = deque(maxlen=SPIKE_WINDOW)  # step, loss
        self._loss_norms: deque[list[float]] = deque(maxlen=SPIKE_WINDOW)
        self.affected: dict[str, int] = {}
        """Per check, how many layers the findings made or extended by the latest snapshot name."""
        self._touched: set[tuple[str, tuple[str, ...]]] = set()

    def update(self, snap: Snapshot) -> list[HealthFinding]:
        """Apply the checks to ``snap``; the findings that are new (not extensions of earlier ones)."""
        persistent: list[Evidence] = []
        immediate: list[Evidence] = []
        on = set(self.checks)
        for name in snap.weights.keys() - self._first_weights.keys():
            grad = snap.grads.get(name)
            self._first_weights[name] = (snap.weights[name], math.sqrt(max(grad.sum_sq, 0.0)) if grad else 0.0)
            if snap.weights[name] < ZERO_START * math.sqrt(snap.weight_sizes.get(name, 1)):
                self._zero_start.add(name)
        self._carried |= frozenset(snap.carried)
        skip = frozenset(self._zero_start) | self._carried  # the gradient of a `.grad` never zeroed: a running sum
        left_out = snap.unoptimized | self._carried
        scheduled = self._scheduled(snap)
        settling, learning, converged, stuck = self._settle(snap)
        # no backward and no gradient in the logging step: `training_step` returned None, skipping its batch
        skipped = snap.gradless and not snap.backward
        if self._zero_losses is not None:  # the losses from step 0, while every one is exactly zero
            starts = not self._zero_losses and snap.losses and snap.losses[0][0] != 0
            zero = all(loss == 0 for _, loss in snap.losses)
            self._zero_losses = None if starts or not zero else self._zero_losses + len(snap.losses)
        from_start = self._zero_losses is not None and self._zero_losses > SETTLED
        stalled = [] if skipped else no_learning(snap, self.limits, from_start)  # then none learns less than another
        # a step the GradScaler skipped has overflowing gradients and no update, one with a loss of exactly zero
        # nothing to learn from, one skipped no gradient: how the layers learn is not seen
        unseen = LEARNING if skipped or snap.skipped_at_scale is not None or zero_loss(snap) else frozenset()
        judged = not stalled and not unseen
        dead = self._dead_units(snap) if "dead_units" in on else []
        immediate += dead
        persistent += copied_units(snap) if "dead_units" in on else []
        decayed = decayed_away(snap, self._first_weights) if "update_ratio" in on and stuck else []
        persistent += decayed
        grown = self._activation_growth(snap, settling, learning) if "activation_growth" in on else []
        grown = [] if decayed else grown  # beside the layers the decay shrank, any output looks huge
        # The layers dead units feed learn nothing, and a layer whose output grew a thousand-fold has weights too large
        # for its steps to move: `dead_units` and `activation_growth` name why.
        large = {e.layers[0] for e in grown}
        starved = skip | fed_by(snap, {e.layers[0] for e in dead}) | {n for n in snap.order if label(n) in large}
        learnt = self._learnt(snap, settling, learning)
        squashed = saturated_layers(snap, learnt) if "saturation" in on else []
        if on & {"vanishing_gradients", "exploding_gradients"} and judged:
            spread = gradient_spread(snap, self.limits, starved, converged)
            # a gradient that fades through saturated units: `saturation` names the cause
            persistent += [e for e in spread if e.check in on and not (squashed and e.group == FADING)]
        if "exploding_gradients" in on:
            immediate += [carried(snap.carried, snap.step)] if snap.carried else []
            immediate += self._norm_growth(snap, left_out)
            immediate += giant_steps(snap, skip) if not unseen else []
        explained = squashed + (vanishing_layers(snap, self.limits, starved) if "vanishing_gradients" in on else [])
        if "update_ratio" in on and judged and not decayed:
            clipped = [e for e in clipped_away(snap, self.limits, skip) if e.check in on]
            persistent += (
                rounded_away(snap, skip)
                or clipped
                or update_ratio(snap, self.limits, starved, scheduled, converged, self._faded(snap), explained)
            )
        if "update_ratio" in on:
            immediate += unoptimized(snap, self.limits)
        persistent += grown
        if "nonfinite" in on:
            immediate += nonfinite(snap, self.limits)
        if "loss_spike" in on:
            immediate += self._loss_spikes(snap, left_out)
        if "saturation" in on:
            persistent += saturation(snap, self.limits, learnt)
        if "input_scale" in on:
            immediate += input_scale(snap, self.limits)
            persistent += absent_inputs(snap)
        if "no_learning" in on:
            immediate += stalled or self._no_backward(snap) or ([] if skipped else self._cut_off(snap))
        self._touched = set()
        new: list[HealthFinding] = []
        held = set()
        for e in persistent:
            key = _key(e)
            held.add(key)
            start, length = self._streaks.get(key, (snap.step, 0))
            self._streaks[key] = (start, length + 1)
            if length + 1 >= self.limits.patience:
                new += self._record(e, start, snap.step)
        for key in [k for k in self._streaks if k not in held and k[0] not in unseen]:
            del self._streaks[key]
        for e in immediate:
            step = snap.step if e.step is None else e.step
            if e.check == "nonfinite":  # NaN spreads: a finding that held at the previous logging step goes on, as
                # it was first seen (later, every layer and weight holds NaN)
                going_on = [f for f in self.findings if f.check == e.check and f.last_step == self._previous_step]
                e = replace(e, layers=going_on[0].layers, message=going_on[0].message) if going_on else e
            new += self._record(e, step, step if e.check in MOMENTS else snap.step)
        self._previous_step = snap.step
        layers: dict[str, set[str]] = {check: set() for check in self.checks}
        for check, names in self._touched:
            layers[check].update(names)
        self.affected = {check: len(names) for check, names in layers.items()}
        return new

    def _no_backward(self, snap: Snapshot) -> list[Evidence]:
        """:func:`no_backward` once no backward pass and no gradient were seen for :data:`SETTLED` steps and two logging
        steps or more in a row (a batch skipped on purpose now and then is not named)."""
        if snap.backwards or not snap.gradless:
            self._backwardless = None
            return []
        since = snap.step if self._backwardless is None else self._backwardless
        self._backwardless = since
        return [no_backward(snap, since)] if snap.step - since >= SETTLED else []

    def _cut_off(self, snap: Snapshot) -> list[Evidence]:
        """The leaves that ran but got no gradient at this logging step and the one before, their weights unchanged in
        between (none stepped them: one that learns on the steps between, a second task's head, is not named)."""
        before, self._ungraded = self._ungraded, {}
        for layer, weights in snap.ungraded.items():
            since, was = before.get(layer, (snap.step, weights))
            self._ungraded[layer] = (since, weights) if was == weights else (snap.step, weights)
        cut = [n for n in snap.order if n in self._ungraded and n in before and self._ungraded[n][0] < snap.step]
        if not cut:
            return []
        return [cut_off(cut, min(self._ungraded[n][0] for n in cut))]

    def _faded(self, snap: Snapshot) -> dict[str, float]:
        """Per layer whose learning rate fell below :data:`FADED` of its peak with half the fit to go (and has not
        risen above it since), that share."""
        shares = {name: lr / self._lr_peak[name] for name, lr in snap.lrs.items() if self._lr_peak.get(name, 0) > 0}
        early = snap.step < snap.total_steps / 2
        self._faded_layers = {n for n, share in shares.items() if share < FADED and (early or n in self._faded_layers)}
        return {name: shares[name] for name in self._faded_layers}

    def _scheduled(self, snap: Snapshot) -> frozenset[str]:
        """The layers whose learning rate changed since the previous logging step or is below its peak (a warm-up or
        a decay in progress), or is the optimizer's own (NaN: Adafactor's relative step)."""
        scheduled = frozenset(
            name
            for name, lr in snap.lrs.items()
            if lr != self._lr_last.get(name, lr) or lr < self._lr_peak.get(name, 0.0)
        )
        for name, lr in snap.lrs.items():
            self._lr_peak[name] = max(lr, self._lr_peak.get(name, 0.0))
        self._lr_last = dict(snap.lrs)
        return scheduled

    def record(self, e: Evidence) -> list[HealthFinding]:
        """``e``, found outside a logging step's checks, as a finding: new, or the extension of its earlier one."""
        step = 0 if e.step is None else e.step
        return self._record(e, step, step)

    def _record(self, e: Evidence, first: int, last: int) -> list[HealthFinding]:
        key = _key(e)
        self._touched.add((e.check, e.layers))
        index = self._index.get(key)
        if index is not None:
            self.findings[index] = replace(
                self.findings[index], layers=e.layers, last_step=last, value=e.value, message=e.message
            )
            return []
        finding = HealthFinding(e.check, e.layers, first, last, e.value, e.threshold, e.message)
        self._index[key] = len(self.findings)
        self.findings.append(finding)
        return [finding]

    def _dead_units(self, snap: Snapshot) -> list[Evidence]:
        """``dead_units`` over a window: units zero for every sample of the last ``patience`` or more logging steps,
        :data:`DEAD_SAMPLES` samples in all; a layer whose every unit is silent is reported at once. A layer keeps the
        checks of its latest window only (and at least ``patience``)."""
        silent = silent_units(snap)
        for name in self._silent.keys() - silent.keys():
            del self._silent[name]
        window: dict[str, list[bool]] = {}
        starts: dict[str, int] = {}
        for name, flags in silent.items():
            kept = self._silent.setdefault(name, deque(maxlen=RISE_MAX))
            if kept and len(kept[-1][1]) != len(flags):
                kept.clear()
            kept.append((snap.step, flags, snap.activations[name].numel / len(flags)))
            recent = list(kept)[::-1]  # newest first: the shortest window of enough checks and samples
            enough = (
                k for k in range(self.limits.patience, len(recent) + 1) if sum(r[2] for r in recent[:k]) >= DEAD_SAMPLES
            )
            if steps := 1 if all(flags) else next(enough, 0):
                window[name] = reduce(_both, (f for _, f, _ in recent[:steps]))  # silent in every one of them
                starts[label(name)] = recent[steps - 1][0]
                while len(kept) > max(steps, self.limits.patience):  # older checks are not needed again: a model
                    kept.popleft()  # of 100 k units kept 64 checks of each, 6.4 M flags
        return [replace(e, step=starts[e.layers[0]]) for e in dead_units(snap, self.limits, window)]

    def _norm_growth(self, snap: Snapshot, left_out: frozenset[str]) -> list[Evidence]:
        """The total gradient norm (per layer, its median since the last logging step) rising ``norm_growth``-fold
        over ``patience`` or more logging steps in a row, or over consecutive steps until it overflowed; without the
        layers ``left_out`` (their ``.grad`` only grows: no optimizer steps it, or nothing zeroes it)."""
        found: list[Evidence] = []
        steps: list[dict[str, float]] = []
        pooled = iter(_per_layer([norms for norms in snap.norms if norms], snap.norm_layers, left_out))
        for (step, _), norms in zip(snap.losses, snap.norms, strict=False):
            if not norms:  # a step whose norms were not taken: the run of consecutive steps is broken
                self._step_norms.clear()
                continue
            layer_norms = next(pooled)
            total = math.hypot(*layer_norms.values())
            if math.isfinite(total):
                steps.append(layer_norms)
                self._step_norms.append((step, layer_norms))
                continue
            run = list(self._step_norms) + ([(step, layer_norms)] if math.isinf(total) else [])
            self._step_norms.clear()
            found += self._grew(run, "steps in a row, then overflowed", snap.clip, overflowed=True)
        if steps:
            level = {n: statistics.median(row[n] for row in steps) for n in steps[0]}
        else:
            level = _per_layer_of(snap, left_out)
        if level and all(math.isfinite(v) for v in level.values()):
            self._logged_norms.append((snap.step, level))
            found += self._grew(list(self._logged_norms), "logging steps in a row", snap.clip)
        return found[:1]

    def _grew(
        self,
        run: list[tuple[int, dict[str, float]]],
        how: str,
        clip: tuple[str, float] | None,
        overflowed: bool = False,
    ) -> list[Evidence]:
        """Evidence when the totals of ``run`` rose at each step, at least ``patience + 1`` of them (the last three
        if it ``overflowed``), ``norm_growth``-fold from the start of the rise, and (over logging steps) from the
        median of the levels before it: a rise out of a dip of a converged run's noisy norms is not a growth."""
        length = 3 if overflowed else self.limits.patience + 1
        totals = [math.hypot(*norms.values()) for _, norms in run]
        rising = 1
        while rising < len(totals) and totals[-rising - 1] < totals[-rising] and not (overflowed and rising == 3):
            rising += 1
        held = totals[:-rising]  # the levels before the rise
        run, totals = run[-rising:], totals[-rising:]
        if len(totals) < length:
            return []
        start = totals[0] if overflowed or not held else max(totals[0], statistics.median(held))
        growth = totals[-1] / max(start, 1e-30)
        if growth < self.limits.norm_growth:
            return []
        (first_step, before), (last_step, after) = run[0], run[-1]
        self._logged_norms.clear()  # the next finding needs a new run of rising norms
        grew = sorted(after, key=lambda n: -_ratio(after[n], before.get(n, 0.0)))[:SHOWN_LAYERS]
        fix = (
            f"gradient clipping (`gradient_clip_val={clip[1]:g}`) bounds each step, not this growth: try a lower "
            f"learning rate, or a smaller initialisation."
            if clip is not None
            else "try gradient clipping (`gradient_clip_val`), a lower learning rate, or a smaller initialisation."
        )
        said = (
            f"the total gradient norm grew {growth:.3g}-fold over {len(totals) - 1} {how} (to {totals[-1]:.3g} "
            f"at step {last_step}), most in {_names(grew)}; {fix}"
        )
        layers = tuple(label(n) for n in grew)
        return [Evidence("exploding_gradients", layers, growth, self.limits.norm_growth, said, step=first_step)]

    def _settle(self, snap: Snapshot) -> tuple[bool, bool, bool, bool]:
        """From the logging step's median loss: whether the run settles here (the first logging step from step
        :data:`SETTLED`, whose loss becomes the reference), whether it is learning (its loss below that reference),
        whether it converged: its loss, or its median layer's mean ``|gradient|``, :data:`CONVERGED` times below the
        first logging step's (gradient descent that reached the least-squares fit of noisy targets: the loss stops at
        the noise, the gradient at 0); and whether it is stuck, its loss not down by half of the first's."""
        loss = statistics.median([v for _, v in snap.losses if math.isfinite(v)] or [math.nan])
        if self._first_loss is None and math.isfinite(loss):
            self._first_loss = loss
        means = mean_gradients(snap)
        gradient = statistics.median(means.values()) if means else math.nan
        if self._first_gradient is None and math.isfinite(gradient):
            self._first_gradient = gradient
        settling = snap.step >= SETTLED and self._reference_loss is None
        if settling:
            self._reference_loss = loss
        learning = loss < self._reference_loss if self._reference_loss is not None else False
        converged = (self._first_loss is not None and 0 < loss * CONVERGED <= self._first_loss) or (
            self._first_gradient is not None and gradient * CONVERGED <= self._first_gradient
        )
        first = self._first_loss
        stuck = first is not None and loss > first - abs(first) / 2  # not when NaN
        return settling, learning, converged, stuck

    def _learnt(self, snap: Snapshot, settling: bool, learning: bool) -> frozenset[str]:
        """The layers that saturated while the loss fell below where the run settled (a sharp attention that solved
        its task), but not those saturated at a logging step before then (weights too large from the start, or a
        learning rate that saturates them in the first steps): :func:`saturation` leaves them."""
        if self._reference_loss is None or settling:
            self._saturated_early |= {n for n, share in snap.saturated.items() if share >= SATURATED}
        return frozenset(snap.saturated) - self._saturated_early if learning else frozenset()

    def _activation_growth(self, snap: Snapshot, settling: bool, learning: bool) -> list[Evidence]:
        """Output RMS ``activation_growth`` times that of every layer that ran before it, or of its own once the run
        settled (see :meth:`_settle`) while the loss did not fall since."""
        limit = self.limits.activation_growth
        found = []
        top = 0.0
        for name in snap.order:
            state = snap.activations.get(name)
            if state is None or not state.numel or state.nonfinite:
                continue
            rms = _rms(state)
            if settling:
                self._reference.setdefault(name, (rms, snap.step))
            first, since = self._reference.get(name, (0.0, snap.step))
            depth = rms / top if top > 0 else 0.0
            time = rms / first if first > 0 and not learning else 0.0
            if depth >= limit or time >= limit:
                how = (
                    f"{depth:.0f} times that of every layer before it"
                    if depth >= time
                    else f"{time:.0f} times what it was at step {since}, while the loss did not fall"
                )
                said = (
                    f"the output of `{label(name)}` has an RMS of {rms:.3g}, {how}: the next overflow is on its "
                    f"way; try normalization layers, a smaller initialisation or a lower learning rate."
                )
                found.append(Evidence("activation_growth", (label(name),), max(depth, time), limit, said))
            top = max(top, rms)
        return found

    def _loss_spikes(self, snap: Snapshot, left_out: frozenset[str]) -> list[Evidence]:
        """Each step since the last logging step whose loss lies ``spike_threshold`` robust deviations above the
        rolling median as it stood then, and :data:`SPIKE_TAIL` times further above it than the highest settled loss
        of the window; a spike on the step right after another extends that finding. The layers ``left_out`` (their
        ``.grad`` only grows) are not named."""
        found = []
        level = self._level()
        highest = max((loss for step, loss in self._losses if step >= SETTLED), default=-math.inf)
        for i, (step, loss) in enumerate(snap.losses):
            norms = snap.norms[i] if i < len(snap.norms) else []
            if not math.isfinite(loss):
                continue
            if level is not None:
                median, scale = level
                z = (loss - median) / scale
                if z > self.limits.spike_threshold and loss - median >= SPIKE_TAIL * (highest - median):
                    spike = self._spike(step, loss, median, z, norms, snap.norm_layers, left_out)
                    if self._last_spike is not None and self._last_spike[0] == step - 1:
                        spike = replace(spike, layers=self._last_spike[1].layers, step=self._last_spike[1].step)
                    self._last_spike = (step, spike)
                    found.append(spike)
                    continue  # a spike does not become the level the next steps are judged by
            self._losses.append((step, loss))
            if norms:
                self._loss_norms.append(norms)
        return found

    def halfway(self) -> float | None:
        """The loss half-way from the rolling median to a spike (``None`` before there is a history): a step whose
        loss stays below it can be neither a spike nor its cause."""
        level = self._level()
        return None if level is None else level[0] + level[1] * self.limits.spike_threshold / 2

    def _level(self) -> tuple[float, float] | None:
        """The loss history's median and robust deviation (``None`` before :data:`SPIKE_MIN_HISTORY` losses)."""
        if len(self._losses) < SPIKE_MIN_HISTORY:
            return None
        median, deviation = loss_level([loss for _, loss in self._losses], self._top_median)
        self._top_median = max(self._top_median, median)
        return median, deviation

    def _spike(
        self,
        step: int,
        loss: float,
        median: float,
        z: float,
        norms: list[float],
        layers: Sequence[str],
        left_out: frozenset[str],
    ) -> Evidence:
        """A spike at ``step``, named after the layers whose gradient norm jumped (:data:`JUMPED`) within
        :data:`ALIKE` of the most (a layer's jump: the least of its parameters' against their window's median), nearest
        the output first; not a layer without a gradient (a target network's copy), nor the layers ``left_out``
        (their ``.grad`` only grows: no optimizer steps it, or nothing zeroes it)."""
        jumps: dict[str, float] = {}
        for j, name in enumerate(layers):
            if name in left_out:
                continue
            past = [row[j] for row in self._loss_norms if j < len(row) and math.isfinite(row[j])]
            if j < len(norms) and norms[j] > 0 and past:  # a parameter without a gradient did not jump
                jump = _ratio(norms[j], statistics.median(past))
                jumps[name] = min(jumps.get(name, math.inf), jump)
        top = max(jumps.values(), default=0.0)
        alike = [n for n in jumps if jumps[n] >= max(top / ALIKE, JUMPED)]
        order = {n: i for i, n in enumerate(dict.fromkeys(layers))}
        worst = sorted(alike, key=lambda n: -order[n])[:SHOWN_LAYERS]
        where = (
            f"; the gradient norm jumped most in {_names(worst)} ({jumps[worst[0]]:.3g}× its recent median)"
            if worst
            else ""
        )
        said = (
            f"the training loss jumped to {loss:.4g} at step {step} (recent median {median:.4g}, {z:.0f} robust "
            f"deviations){where}; look at that batch, lower the learning rate, or clip gradients."
        )
        layers = tuple(label(n) for n in worst) or ("root",)
        return Evidence("loss_spike", layers, z, self.limits.spike_threshold, said, step=step)


def loss_level(history: Sequence[float], top_median: float = 0.0) -> tuple[float, float]:
    """The median of the losses ``history`` and their robust deviation: ``1.4826 × MAD``, but at least
    :data:`SPIKE_FLOOR` of the highest rolling median seen in the fit (``top_median``, or this one)."""
    median = statistics.median(history)
    mad = statistics.median(abs(x - median) for x in history)
    return median, max(MAD_SCALE * mad, SPIKE_FLOOR * max(top_median, median), 1e-12)


def _key(e: Evidence) -> tuple[str, tuple[str, ...]]:
    """The finding ``e`` makes or extends: its check's over its layers, or over its group's."""
    return (e.check, e.layers if e.group is None else (e.group,))


def _names(layers: Sequence[str]) -> str:
    return ", ".join(f"`{label(n)}`" for n in layers)


def _rms(state: State) -> float:
    return math.sqrt(max(state.sum_sq, 0.0) / state.numel) if state.numel else math.nan


def _ratio(new: float, old: float) -> float:
    return new / old if old > 0 else (math.inf if new > 0 else 1.0)


def _per_layer_of(snap: Snapshot, left_out: frozenset[str]) -> dict[str, float]:
    """Each layer's gradient norm in the snapshot, but for the layers ``left_out``."""
    return {name: math.sqrt(max(s.sum_sq, 0.0)) for name, s in snap.grads.items() if name not in left_out}


def _per_layer(
    rows: Sequence[Sequence[float]], layers: Sequence[str], left_out: frozenset[str]
) -> list[dict[str, float]]:
    """Each row of per-parameter norms pooled into its layers' (the 2-norm of the layer's parameters together, an Inf
    winning over a NaN), but for the layers ``left_out`` (their ``.grad`` only grows: no optimizer steps it, or
    nothing zeroes it)."""
    indices: dict[str, list[int]] = {}
    for i, name in enumerate(layers):
        if name not in left_out:
            indices.setdefault(name, []).append(i)
    # math.hypot and itemgetter run in C: a logging step can pool every step's norms since the last one
    plan = [(name, operator.itemgetter(*found), len(found) > 1) for name, found in indices.items()]
    return [{name: math.hypot(*get(row)) if many else math.hypot(get(row)) for name, get, many in plan} for row in rows]


def _both(a: list[bool], b: list[bool]) -> list[bool]:
    """Element by element, ``a and b`` (at C speed: a model has some 100 k units)."""
    return list(map(operator.and_, a, b))

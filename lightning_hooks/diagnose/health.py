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
    MIN_LABELS,
    PEER_GAP,
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
    listed,
    mean_gradients,
    no_backward,
    no_learning,
    nonfinite,
    one_class,
    oversized_start,
    peer_medians,
    rounded_away,
    saturated_layers,
    saturation,
    scaled_down,
    silent_units,
    sorted_batches,
    unoptimized,
    update_ratio,
    vanishing_layers,
    zero_loss,
)
from lightning_hooks.diagnose.moments import RISE_MAX, Moments
from lightning_hooks.stats.state import rms as state_rms

__all__ = [
    "CHECKS",
    "Check",
    "HealthFinding",
    "HealthTracker",
    "Snapshot",
    "Thresholds",
    "dead_units",
    "gradient_spread",
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

MOMENTS = ("loss_spike", "exploding_gradients")
"""Immediate checks whose evidence belongs to one moment (a step, a run of steps), not to the logging step."""
LEARNING = frozenset({"vanishing_gradients", "exploding_gradients", "update_ratio"})
"""The checks that judge how each layer learns, from its gradients and update."""
DEAD_SAMPLES = 512
"""``dead_units`` judges a layer whose units are not all silent over a window of at least this many samples."""
ZERO_START = 1e-4
"""A layer whose weights' RMS is below this when first seen started at zero by design (LoRA's B, layer scale)."""


@dataclass(frozen=True)
class HealthFinding:
    """A problem the monitor found: which check, where, since when, the evidence and what to try.

    Attributes:
        check: One of :data:`CHECKS`.
        layers: Qualified module names (``root`` for the LightningModule), worst first; up to three (the message
            says how many more).
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

        >>> from lightning_hooks.stats.state import State
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
        self._previous_step = -1
        self._moments = Moments(limits)
        self._reference: dict[str, tuple[float, int]] = {}  # per layer, its output RMS once the run settled
        self._initial: dict[str, tuple[float, int]] = {}  # per layer, its output RMS at its first check, and when
        self._reference_loss: float | None = None
        self._first_loss: float | None = None  # the median loss of the first logging step
        self._first_gradient: float | None = None  # and its median layer's mean |gradient|
        self._saturated_early: set[str] = set()  # the layers saturated at a logging step before the run settled
        self._zero_start: set[str] = set()
        self._scaled_down: frozenset[str] = frozenset()  # the layers behind them (see scaled_down)
        self._first_weights: dict[str, tuple[float, float]] = {}  # per layer, its weights' and gradient's norms when
        # first seen
        self._lr_peak: dict[str, float] = {}  # per layer, the highest learning rate of the fit so far
        self._lr_last: dict[str, float] = {}  # and the one at the previous logging step
        self._faded_layers: set[str] = set()  # the layers whose learning rate faded early (see _faded)
        self._ungraded: dict[str, tuple[int, tuple[float, ...]]] = {}  # per layer, since when, and its fingerprint
        self._zero_losses: int | None = 0  # steps from step 0 whose loss was exactly zero, None after any other
        self._backwardless: int | None = None  # since when no backward ran and no gradient came (see _no_backward)
        self._classes: deque[tuple[int, int, float | None]] = deque(maxlen=RISE_MAX)  # per logging step, its batch
        # index and its labels' class
        self._labels_path = ""  # the batch tensor they are read from
        self._carried: frozenset[str] = frozenset()  # the layers whose `.grad` was found not zeroed between steps
        self._silent: dict[str, deque[tuple[int, list[bool], float]]] = {}  # step, silent units, samples per unit
        self.affected: dict[str, int] = {}
        """Per check, how many layers the findings made or extended by the latest snapshot name."""
        self._touched: set[tuple[str, tuple[str, ...]]] = set()

    def update(self, snap: Snapshot) -> list[HealthFinding]:
        """Apply the checks to ``snap``; the findings that are new (not extensions of earlier ones)."""
        persistent: list[Evidence] = []
        immediate: list[Evidence] = []
        on = set(self.checks)
        zero = len(self._zero_start)
        for name in snap.weights.keys() - self._first_weights.keys():
            grad = snap.grads.get(name)
            self._first_weights[name] = (snap.weights[name], math.sqrt(max(grad.sum_sq, 0.0)) if grad else 0.0)
            if snap.weights[name] < ZERO_START * math.sqrt(snap.weight_sizes.get(name, 1)):
                self._zero_start.add(name)
        if len(self._zero_start) > zero:
            self._scaled_down = scaled_down(self._zero_start, snap.order)
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
        grown = self._activation_growth(snap, settling, learning, stuck) if "activation_growth" in on else []
        grown = [] if decayed else grown  # beside the layers the decay shrank, any output looks huge
        if "activation_growth" in on and self._previous_step < 0 and not grown:  # a layer's own leap names itself
            immediate += oversized_start(snap)
        # The layers dead units feed learn nothing, and a layer whose output grew a thousand-fold has weights too large
        # for its steps to move: `dead_units` and `activation_growth` name why. Those behind a scale that started at
        # zero get its small gradient by design.
        large = {e.layers[0] for e in grown}
        silenced = {e.layers[0] for e in dead if e.value >= 1.0}  # every unit dead
        starved = skip | self._scaled_down | fed_by(snap, {e.layers[0] for e in dead}, silenced)
        starved |= {n for n in snap.order if label(n) in large}
        learnt = self._learnt(snap, settling, learning)
        squashed = saturated_layers(snap, learnt) if "saturation" in on else []
        if "vanishing_gradients" in on and judged:
            spread = gradient_spread(snap, self.limits, starved, converged)
            # a gradient that fades through saturated units: `saturation` names the cause
            persistent += [e for e in spread if not (squashed and e.group == FADING)]
        if "exploding_gradients" in on:
            immediate += [carried(snap.carried, snap.step)] if snap.carried else []
            immediate += self._moments.growth(snap, left_out)
            immediate += giant_steps(snap, skip) if not unseen else []
        fading = vanishing_layers(snap, self.limits, starved) if "vanishing_gradients" in on else []
        if "update_ratio" in on and judged and not decayed:
            clipped = [e for e in clipped_away(snap, self.limits, skip) if e.check in on]
            persistent += (
                rounded_away(snap, skip)
                or clipped
                or update_ratio(snap, self.limits, starved, scheduled, converged, self._faded(snap), squashed, fading)
            )
        if "update_ratio" in on:
            immediate += unoptimized(snap, self.limits)
        persistent += grown
        if "nonfinite" in on:
            immediate += nonfinite(snap, self.limits)
        if "loss_spike" in on:  # not over batches of a few labels: a hard sample's loss is the batch's
            few = any(count < MIN_LABELS for count, _, _ in snap.labels.values())
            immediate += self._moments.spikes(snap, left_out, judged=not few)
        if "saturation" in on:
            said = saturation(snap, self.limits, learnt)
            persistent += said
            output = {e.layers[0] for e in said if e.group != "saturated layers"}  # its dead outputs are its doing
            immediate = [e for e in immediate if not (e.check == "dead_units" and e.layers[0] in output)]
        if "input_scale" in on:
            immediate += input_scale(snap, self.limits) + self._sorted_batches(snap)
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

    def _sorted_batches(self, snap: Snapshot) -> list[Evidence]:
        """:func:`sorted_batches` over the logging steps' class labels so far (a step without one class of the model's
        output starts again)."""
        path, labels = next(iter(snap.labels.items()), ("", None))
        if labels is None or path != self._labels_path:
            self._classes.clear()
            self._labels_path = path
        if labels is None:
            return []
        self._classes.append((snap.step, snap.batch_index, one_class(labels, snap.output_width)))
        return sorted_batches(self._classes, path, self.limits)

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

    def halfway(self) -> float | None:
        """The loss half-way from the rolling median to a spike (``None`` before there is a history): a step whose
        loss stays below it can be neither a spike nor its cause."""
        return self._moments.halfway()

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

    def _activation_growth(self, snap: Snapshot, settling: bool, learning: bool, stuck: bool) -> list[Evidence]:
        """Output RMS ``activation_growth`` times that of every layer that ran before it, or of its own once the run
        settled (see :meth:`_settle`) while the loss did not fall since, but for a layer whose weights started at zero
        (LoRA's B: under a warm-up its output at step 10 is a thousandth of where it goes). And, in one finding, the
        layers whose parameter group has :data:`PEER_GAP` times its peers' learning rate and whose output reached an RMS
        of a tenth of ``activation_growth``, that many times above every layer before it or its own at its first check,
        while the loss is stuck (a transformer block at a hundredfold AdamW rate: outputs of RMS 100-500 where they
        started at 1, and the loss at chance; a head drawn small that a tenfold rate grows to unit scale stays
        below)."""
        limit = self.limits.activation_growth
        lrs = {name: lr for name, lr in snap.lrs.items() if math.isfinite(lr)}
        peers = peer_medians(lrs) if stuck and lrs else {}
        found = []
        fast: list[tuple[str, float, str]] = []  # of a fast group, grown: the layer, how many times, and how said
        top = 0.0
        for name in snap.order:
            state = snap.activations.get(name)
            if state is None or not state.numel or state.nonfinite:
                continue
            rms = state_rms(state)
            if settling:
                self._reference.setdefault(name, (rms, snap.step))
            initial = self._initial.setdefault(name, (rms, snap.step))
            first, since = self._reference.get(name, (0.0, snap.step))
            depth = rms / top if top > 0 else 0.0
            time = rms / first if first > 0 and not learning and name not in self._zero_start else 0.0
            top = max(top, rms)
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
            elif name in peers and lrs[name] >= PEER_GAP * peers[name] and rms >= limit / PEER_GAP:
                since_start = rms / initial[0] if initial[0] > 0 else 0.0
                if max(depth, since_start) >= limit / PEER_GAP:
                    how = (
                        f"{depth:.0f} times that of every layer before it"
                        if depth >= since_start
                        else f"{since_start:.0f} times what it was at step {initial[1]}"
                    )
                    fast.append((name, max(depth, since_start), f"`{label(name)}`: an RMS of {rms:.3g}, {how}"))
        if fast:
            name = fast[0][0]
            said = listed([n for n, _, _ in fast]) + (
                f" give outputs far above their start while the loss is not down by half ({fast[0][2]}): their "
                f"parameter group's learning rate, {lrs[name]:.0e}, is ten times or more its peers' "
                f"({peers[name]:.0e}), too high for them; lower it."
            )
            layers = tuple(label(n) for n, _, _ in fast[:SHOWN_LAYERS])
            found.append(
                Evidence("activation_growth", layers, max(g for _, g, _ in fast), limit / PEER_GAP, said, group=FAST)
            )
        return found


FAST = "grown in a fast group"
"""The group of ``activation_growth``'s finding over the layers of a parameter group whose learning rate grew them."""


def _key(e: Evidence) -> tuple[str, tuple[str, ...]]:
    """The finding ``e`` makes or extends: its check's over its layers, or over its group's."""
    return (e.check, e.layers if e.group is None else (e.group,))


def _both(a: list[bool], b: list[bool]) -> list[bool]:
    """Element by element, ``a and b`` (at C speed: a model has some 100 k units)."""
    return list(map(operator.and_, a, b))

"""What happens between logging steps: loss spikes, and a gradient norm that grows step after step (pure Python)."""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from lightning_hooks.core.select import label
from lightning_hooks.diagnose.checks.snapshot import SETTLED, SHOWN_LAYERS, Evidence, Snapshot, Thresholds, listed

__all__ = ["RISE_MAX", "SPIKE_MIN_HISTORY", "SPIKE_WINDOW", "UNBOUNDED", "Moments", "loss_level"]

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
RISE_MAX = 64
"""``exploding_gradients`` follows a steady rise of the gradient norm over at most this many logging steps."""
UNBOUNDED = 10.0
"""An ``exploding_gradients`` growth is a loss without a lower bound when the loss is negative and this many times the
first step's in magnitude (``nll_loss`` of logits starts near 0 and falls without end)."""


class Moments:
    """The losses and gradient norms of the steps between logging steps, kept over a rolling window: a step whose loss
    spikes, and a total gradient norm that rises step after step or logging step after logging step."""

    def __init__(self, limits: Thresholds) -> None:
        self.limits = limits
        self._step_norms: deque[tuple[int, dict[str, float]]] = deque(maxlen=limits.patience + 1)
        self._logged_norms: deque[tuple[int, dict[str, float]]] = deque(maxlen=RISE_MAX)
        self._top_median = 0.0
        self._last_spike: tuple[int, Evidence] | None = None
        self._losses: deque[tuple[int, float]] = deque(maxlen=SPIKE_WINDOW)  # step, loss
        self._kept = 0  # losses kept so far: the level below was taken when there were as many
        self._level_at: tuple[int, tuple[float, float]] | None = None
        self._loss_norms: deque[list[float]] = deque(maxlen=SPIKE_WINDOW)
        self._top_level = 0.0  # the highest median of the logged levels before a rise, over the fit
        self._zero_norms = 0  # of the norms kept, how many are exactly 0 (a parameter without a gradient in its step)
        self._start: tuple[float, dict[str, float]] | None = None  # the first step's loss and layers' gradient norms
        self._diverged = False

    def growth(self, snap: Snapshot, left_out: frozenset[str]) -> list[Evidence]:
        """The total gradient norm (per layer, its median since the last logging step) rising ``norm_growth``-fold
        over ``patience`` or more logging steps in a row, or over consecutive steps until it overflowed; without the
        layers ``left_out`` (their ``.grad`` only grows: no optimizer steps it, or nothing zeroes it). Logging steps
        are counted from the first after step 0: a gradient may start a hundred times below its working level (a
        contrastive loss over embeddings that all start alike: SimCLR's grows from 0.03 to 1.7 in 50 steps, then
        stays within 1.6-6.2). A step that ran a part of the model the steps before it did not (:meth:`_new_path`: a
        rare task's head, whose gradient is 100-250 times a converged main task's) is no step of a rise."""
        found: list[Evidence] = []
        steps: list[dict[str, float]] = []
        other = False  # a step of another kind of batch was left out
        absent = self._absent()
        unbounded = self._unbounded(snap)
        pooled = iter(_per_layer([norms for norms in snap.norms if norms], snap.norm_layers, left_out))
        for (step, _), norms in zip(snap.losses, snap.norms, strict=False):
            if not norms:  # a step whose norms were not taken: the run of consecutive steps is broken
                self._step_norms.clear()
                continue
            layer_norms = next(pooled)
            total = math.hypot(*layer_norms.values())
            if math.isfinite(total):
                if self._new_path(norms, absent):  # another kind of batch: it breaks the run of steps
                    self._step_norms.clear()
                    other = True
                else:
                    steps.append(layer_norms)
                    self._step_norms.append((step, layer_norms))
                continue
            run = list(self._step_norms) + ([(step, layer_norms)] if math.isinf(total) else [])
            self._step_norms.clear()
            found += self._grew(run, "steps in a row, then overflowed", snap.clip, unbounded, True)
        if steps:
            level = {n: statistics.median(row[n] for row in steps) for n in steps[0]}
        elif other:
            return found[:1]  # every step since the last logging step was of another kind
        else:
            level = _per_layer_of(snap, left_out)
        if level and all(math.isfinite(v) for v in level.values()):
            if snap.step > 0:  # not the initialisation's, which may start far below the working level
                self._logged_norms.append((snap.step, level))
            found += self._grew(list(self._logged_norms), "logging steps in a row", snap.clip, unbounded)
            found += self._diverging(snap, level, steps[0] if steps else level)
        return found[:1]

    def _diverging(self, snap: Snapshot, level: dict[str, float], earliest: dict[str, float]) -> list[Evidence]:
        """The loss and the total gradient norm (``level``: per layer, its median since the last logging step) both
        ``norm_growth``-fold above the fit's first step's, or more (``earliest``: the first step's norms, at the first
        call): the training diverged, for good rather than for a step (a spike). Said once."""
        losses = [loss for _, loss in snap.losses if math.isfinite(loss)]
        if self._start is None and losses:
            self._start = (losses[0], earliest)
            return []
        if self._start is None or self._diverged or not losses:
            return []
        (loss0, norms0), loss = self._start, statistics.median(losses)
        norm0 = math.hypot(*norms0.values())
        growth = math.hypot(*level.values()) / norm0 if norm0 > 0 else 0.0
        if not (loss0 > 0 and loss >= self.limits.norm_growth * loss0 and growth >= self.limits.norm_growth):
            return []
        self._diverged = True
        grew = sorted(level, key=lambda n: -_ratio(level[n], norms0.get(n, 0.0)))[:SHOWN_LAYERS]
        said = (
            f"the loss rose from {loss0:.3g} at the first step to {loss:.3g} at step {snap.step} (the median since the "
            f"last logging step) and the total gradient norm {growth:.3g}-fold, most in {listed(grew)}: the training "
            f'diverged; lower the learning rate (a loss summed over the batch, `reduction="sum"`, makes each step as '
            f"many times larger as the batch has samples), or clip gradients (`gradient_clip_val`)."
        )
        return [
            Evidence("exploding_gradients", tuple(label(n) for n in grew), loss / loss0, self.limits.norm_growth, said)
        ]

    def _unbounded(self, snap: Snapshot) -> float | None:
        """The loss (its median since the last logging step) when it is negative and :data:`UNBOUNDED` times the
        first step's or more in magnitude: a loss with no lower bound, falling as the weights grow."""
        losses = [loss for _, loss in snap.losses if math.isfinite(loss)]
        loss = statistics.median(losses) if losses and self._start is not None else 0.0
        return loss if loss < 0 and abs(loss) >= UNBOUNDED * abs(self._start[0] if self._start else 0.0) else None

    def _grew(
        self,
        run: list[tuple[int, dict[str, float]]],
        how: str,
        clip: tuple[str, float] | None,
        unbounded: float | None = None,
        overflowed: bool = False,
    ) -> list[Evidence]:
        """Evidence when the totals of ``run`` rose at each step, at least ``patience + 1`` of them (the last three
        if it ``overflowed``), ``norm_growth``-fold from the start of the rise, and (over logging steps) from the
        median of the levels before it: a rise out of a dip of a converged run's noisy norms is not a growth. Over
        logging steps, it must also end above the highest such median of the fit: a converged run's norm, thousands of
        times under its early level, can rise a hundredfold on a few batches and still be below where the run has
        been. Its fix is the loss's when the loss is ``unbounded`` (see :meth:`_unbounded`)."""
        length = 3 if overflowed else self.limits.patience + 1
        totals = [math.hypot(*norms.values()) for _, norms in run]
        rising = 1
        while rising < len(totals) and totals[-rising - 1] < totals[-rising] and not (overflowed and rising == 3):
            rising += 1
        held = totals[:-rising]  # the levels before the rise
        run, totals = run[-rising:], totals[-rising:]
        level = statistics.median(held) if held and not overflowed else 0.0
        self._top_level = max(self._top_level, level)
        if len(totals) < length:
            return []
        start = max(totals[0], level)
        growth = totals[-1] / max(start, 1e-30)
        if growth < self.limits.norm_growth or (not overflowed and totals[-1] < self._top_level):
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
        if unbounded is not None:
            fix = (
                f"the loss is negative and falls with it (to {unbounded:.3g}): it has no lower bound, as `nll_loss` "
                f"given logits has (it takes log-probabilities: apply `log_softmax` first, or use `cross_entropy`); "
                f"clipping or a lower learning rate would only slow the fall."
            )
        said = (
            f"the total gradient norm grew {growth:.3g}-fold over {len(totals) - 1} {how} (to {totals[-1]:.3g} "
            f"at step {last_step}), most in {listed(grew)}; {fix}"
        )
        layers = tuple(label(n) for n in grew)
        return [Evidence("exploding_gradients", layers, growth, self.limits.norm_growth, said, step=first_step)]

    def spikes(self, snap: Snapshot, left_out: frozenset[str], judged: bool = True) -> list[Evidence]:
        """Each step since the last logging step whose loss lies ``spike_threshold`` robust deviations above the
        rolling median as it stood then, and :data:`SPIKE_TAIL` times further above it than the highest settled loss
        of the window, unless the step ran a part of the model the steps before it did not (:meth:`_new_path`); a
        spike on the step right after another extends that finding. The layers ``left_out`` (their ``.grad`` only
        grows) are not named. Unless ``judged``, the losses are only kept (batches of a few samples, where one hard
        sample is the batch's loss)."""
        found = []
        level = self._level()
        highest = max((loss for step, loss in self._losses if step >= SETTLED), default=-math.inf)
        for i, (step, loss) in enumerate(snap.losses):
            norms = snap.norms[i] if i < len(snap.norms) else []
            if not math.isfinite(loss):
                continue
            if level is not None and judged:
                median, scale = level
                z = (loss - median) / scale
                if z > self.limits.spike_threshold and loss - median >= SPIKE_TAIL * (highest - median):
                    if self._new_path(norms, self._absent()):
                        continue  # another kind of batch (a rare task's head ran): its loss is not this level's
                    spike = self._spike(step, loss, median, z, norms, snap.norm_layers, left_out)
                    if self._last_spike is not None and self._last_spike[0] == step - 1:  # its finding, extended
                        spike = replace(spike, layers=self._last_spike[1].layers)
                    self._last_spike = (step, spike)
                    found.append(spike)
                    continue  # a spike does not become the level the next steps are judged by
            self._losses.append((step, loss))
            self._kept += 1
            if norms:
                if len(self._loss_norms) == self._loss_norms.maxlen:
                    self._zero_norms -= self._loss_norms[0].count(0.0)
                self._loss_norms.append(norms)
                self._zero_norms += norms.count(0.0)
        return found

    def _absent(self) -> list[int]:
        """The parameters (their places in a step's gradient norms) that had no gradient at most of the steps kept;
        none, at once, when every kept norm is above 0."""
        if not self._zero_norms:
            return []
        width = max(len(row) for row in self._loss_norms)
        return [
            j
            for j in range(width)
            if (past := [row[j] for row in self._loss_norms if j < len(row) and math.isfinite(row[j])])
            and statistics.median(past) == 0
        ]

    @staticmethod
    def _new_path(norms: list[float], absent: list[int]) -> bool:
        """Whether a parameter has a gradient in the step of gradient ``norms`` but had none at most of the steps kept
        before (``absent``; a task's head that runs on its own rare batches of a multi-task fit, a branch): the batch is
        of another kind than those, and its loss is not judged against theirs, nor its gradient as a step of a rise."""
        return any(norms[j] > 0 for j in absent if j < len(norms))

    def halfway(self) -> float | None:
        """The loss half-way from the rolling median to a spike (``None`` before there is a history): a step whose
        loss stays below it can be neither a spike nor its cause."""
        level = self._level()
        return None if level is None else level[0] + level[1] * self.limits.spike_threshold / 2

    def _level(self) -> tuple[float, float] | None:
        """The loss history's median and robust deviation (``None`` before :data:`SPIKE_MIN_HISTORY` losses), taken
        again only when a loss was kept since (:meth:`halfway` after a logging step's checks, :meth:`spikes` at the
        next one, ask the same)."""
        if len(self._losses) < SPIKE_MIN_HISTORY:
            return None
        if self._level_at is None or self._level_at[0] != self._kept:
            median, deviation = loss_level([loss for _, loss in self._losses], self._top_median)
            self._top_median = max(self._top_median, median)
            self._level_at = (self._kept, (median, deviation))
        return self._level_at[1]

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
            f"; the gradient norm jumped most in {listed(worst)} ({jumps[worst[0]]:.3g}× its recent median)"
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

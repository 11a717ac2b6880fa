"""Checks on the batch: inputs or targets far from unit scale, all zeros, or batches sorted by class; and a model whose
output starts far from unit scale."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from lightning_hooks.core.select import label
from lightning_hooks.diagnose.checks.snapshot import (
    Evidence,
    Snapshot,
    Thresholds,
)
from lightning_hooks.stats.state import rms as state_rms

__all__ = [
    "INPUT_SCALE",
    "ALIKE_SCALE",
    "START_SCALE",
    "MIN_LABELS",
    "input_scale",
    "absent_inputs",
    "oversized_start",
    "one_class",
    "sorted_batches",
]

INPUT_SCALE = 100.0
"""``input_scale`` names a batch tensor whose RMS (over its non-zero values) is this many times off unit scale."""


ALIKE_SCALE = 10.0
"""Two scales within this factor of each other are alike (a series and its forecast, a loss and the tensor it
compares outputs with), and one within it of 1 is unit scale (what a model that rescales its inputs gives its first
layer)."""


def input_scale(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """Floating-point batch tensors whose RMS over their non-zero values is :data:`INPUT_SCALE` times off unit scale
    (a sparse input, such as a TF-IDF row normalised to unit length, is small only in its zeros), named after the
    layer that took the tensor, a view of it or a copy made of it (else the first layer to take a floating-point
    tensor, or the last one to run for the batch's last tensor, a target compared with the output). Only when what
    that layer took is still :data:`ALIKE_SCALE` times off, on the same side: a model that divides its pixels by 255
    itself, or slices the numeric columns out of a batch that also holds category indices, gives its first layer
    values of unit scale. Not when that layer is a normalization: the model standardises it. Nor targets within
    :data:`ALIKE_SCALE` of inputs the model rescales itself: a forecaster that normalises each window of a series and
    de-normalises its forecast (RevIN) is judged on the series' own scale. Nor a last tensor above the range while
    the loss is :data:`ALIKE_SCALE` times below its RMS: a loss that compared outputs of unit scale with it (an L1
    loss, a squared one) would be far above, so it is something the loss uses otherwise, or not at all: sample
    weights, survival times that only a Cox loss's ordering reads, boxes in pixels that a box coder normalises,
    timestamps."""
    found = []
    paths = list(snap.inputs)
    losses = [abs(loss) for _, loss in snap.losses if math.isfinite(loss)]
    loss = statistics.median(losses) if losses else math.inf
    rescaled = []  # the RMS of the inputs the model brought to unit scale itself
    for path, rms in snap.inputs.items():
        target = len(paths) > 1 and path == paths[-1]
        taker, took = _taker(snap, path, rms, entry=not target)
        side = _off_scale(rms)
        if not side:
            continue
        if _off_scale(took, ALIKE_SCALE) != side:  # the model brought it (near) to unit scale itself
            rescaled.append(rms)
            continue
        if taker in snap.normalizers:
            continue
        if target and any(max(rms, r) < ALIKE_SCALE * min(rms, r) for r in rescaled):
            continue
        if target and taker is None and side > 0 and loss * ALIKE_SCALE < rms:
            continue
        layers = [taker] if taker is not None else snap.executed[-1:] if target else snap.executed[:1]
        what = "targets" if target else "inputs"
        if side > 0:
            effect = f"unscaled {what} make huge activations, losses and gradients from the first step"
        elif target:
            effect = (
                "a freshly initialised model's outputs are far larger than such targets, and it spends its first "
                "steps shrinking them; scale its predictions back afterwards"
            )
        else:
            effect = "the first layer's output is then mostly its bias, and its weights' gradients are as small"
        said = (
            f"the batch's {what} (`{path}`) have an RMS of {rms:.3g} (over their non-zero values), "
            f"{abs(math.log10(rms)):.0f} orders of magnitude "
            f"from unit scale: standardise them (subtract the training set's mean, divide by its standard "
            f"deviation); {effect}."
        )
        found.append(Evidence("input_scale", tuple(label(n) for n in layers) or ("root",), rms, INPUT_SCALE, said))
    return found


def absent_inputs(snap: Snapshot) -> list[Evidence]:
    """Floating-point batch tensors with no finite non-zero value (all zeros: data never loaded into a buffer made with
    ``torch.zeros``, a transform that multiplies by 0), taken as they are by the layer that takes them, or by the first
    layer to take a floating-point tensor: every sample looks alike to the model, which can learn no more than the
    mean target. Only when every floating-point input is so (an RNN's initial state may be zeros beside its inputs),
    not counting the batch's last tensor of several (a target, possibly all zeros in a batch); and not one a layer
    takes only after adding something to it (a learnt embedding)."""
    paths = list(snap.inputs)
    inputs = {path: rms for path, rms in snap.inputs.items() if len(paths) == 1 or path != paths[-1]}
    if any(rms != 0 for rms in inputs.values()):  # another input carries the samples (an RNN's zero initial state)
        return []
    found = []
    for path, rms in inputs.items():
        taker, took = _taker(snap, path, rms)
        if taker is None or took != 0:
            continue
        said = (
            f"the batch's inputs (`{path}`) hold no finite non-zero value: every sample is all zeros, so "
            f"`{label(taker)}` gives each the same output and the model can learn no more than the mean target; check "
            f"the data loading (a buffer made with `torch.zeros` and never filled, a wrong column or key, a transform "
            f"that multiplies by 0)."
        )
        found.append(Evidence("input_scale", (label(taker),), 0.0, 0.0, said))
    return found


START_SCALE = 100.0
"""``oversized_start`` names a model whose output's RMS is this much or more at its first check (from PyTorch's default
initialisation a digits MLP's logits start at about 0.06, GPT-2's and BERT's below 1)."""


def oversized_start(snap: Snapshot) -> list[Evidence]:
    """The model's output (that of the last layer with weights to run) with an RMS of :data:`START_SCALE` or more at
    the first check, though the inputs its first layer takes are within :data:`ALIKE_SCALE` of unit scale (else
    ``input_scale`` names them) and the batch's targets, where it has floating-point ones beside the inputs, are not
    within :data:`ALIKE_SCALE` of the output (a regressor started at its targets' mean): weights drawn far too large,
    as ``torch.randn`` gives them unless scaled by ``1 / sqrt(fan_in)``. The first steps are spent shrinking them.
    Named after the first layer with weights whose output's RMS passes :data:`ALIKE_SCALE`, where the scale goes
    wrong, and the output layer."""
    rms = {n: state_rms(s) for n, s in snap.activations.items() if s.numel and not s.nonfinite}
    weighted = [n for n in snap.executed if n in snap.leaves_with_params and n in rms]
    if not weighted or rms[output := weighted[-1]] < START_SCALE:
        return []
    if snap.entry is not None and snap.entry[1] >= ALIKE_SCALE:
        return []
    paths = list(snap.inputs)
    if len(paths) > 1 and snap.inputs[paths[-1]] * ALIKE_SCALE > rms[output]:
        return []
    first = next(n for n in weighted if rms[n] >= ALIKE_SCALE)
    layers = tuple(dict.fromkeys([label(first), label(output)]))
    said = (
        f"the model's output (`{label(output)}`) has an RMS of {rms[output]:.3g} at step {snap.step}, before it has "
        f"learnt anything, and `{label(first)}` is the first layer whose output passes {ALIKE_SCALE:g}: the weights "
        f"start far too large (from a sound initialisation a classifier's logits start below about 1), and the first "
        f"steps go to shrinking them. Keep PyTorch's default initialisation, or use `nn.init.kaiming_normal_` (ReLU) "
        f"or `xavier_normal_` (tanh); weights made with `torch.randn(fan_in, fan_out)` need scaling by "
        f"`fan_in ** -0.5`."
    )
    return [Evidence("activation_growth", layers, rms[output], START_SCALE, said)]


def _taker(snap: Snapshot, path: str, rms: float, entry: bool = True) -> tuple[str | None, float]:
    """The layer that took the batch tensor ``path`` (of RMS ``rms``) and the RMS of what it took; else, with
    ``entry``, the first layer to take a floating-point tensor and that tensor's RMS."""
    taker, took = snap.input_takers.get(path), snap.taken.get(path, rms)
    if taker is None and entry and snap.entry is not None:
        return snap.entry
    return taker, took


def _off_scale(rms: float, factor: float = INPUT_SCALE) -> int:
    """1 for an RMS ``factor`` times above 1 or more, -1 for one as far below (but not 0), else 0."""
    return 1 if rms >= factor else -1 if 0 < rms <= 1 / factor else 0


MIN_LABELS = 8
"""``input_scale`` judges the class labels of a batch that holds at least this many (8 labels drawn at random from two
balanced classes are all one class once in 128 batches; three such batches in a row, once in two million)."""


def one_class(labels: tuple[float, float, float], width: int = 0) -> float | None:
    """The class every label of a batch is, from their count, sum and sum of squares (their squared deviations add up
    to 0, where labels of two classes give at least ``(n - 1) / n``); None when they differ, are fewer than
    :data:`MIN_LABELS`, or are no index of the model's output of ``width`` values (0: unknown), as the lengths of
    sequences bucketed one length a batch are not."""
    count, total, squares = labels
    if count < MIN_LABELS or squares - total * total / count >= 0.5:
        return None
    value = total / count
    return value if not width or 0 <= value < width else None


def sorted_batches(seen: Sequence[tuple[int, int, float | None]], path: str, limits: Thresholds) -> list[Evidence]:
    """A training set sorted by class and not shuffled: the batch checked at each of the last ``patience`` logging
    steps or more (``seen``: per logging step, in order, its index in its epoch and the one class of its labels
    ``path``, or None) held a single class, two or more classes came in turn, and in the loader's order (by batch
    index) each class fills one stretch of batches, one of them two batches or more: the classes lie in blocks. Each
    batch teaches the model that every sample is of its class: it forgets the others between their turns. Tasks
    taken in turn (0, 1, 0, 1 by batch index) or batches of one length each in a shuffled order are not blocks. Named
    after the model (``root``): no layer is to blame."""
    run: list[tuple[int, int, float]] = []
    for step, index, value in reversed(seen):
        if value is None:
            break
        run.insert(0, (step, index, value))
    classes = list(dict.fromkeys(value for _, _, value in run))
    in_order = [value for _, value in sorted({(index, value) for _, index, value in run})]
    stretches = [value for i, value in enumerate(in_order) if i == 0 or in_order[i - 1] != value]
    blocks = len(stretches) == len(classes) < len(in_order)
    if len(run) < limits.patience or len(classes) < 2 or not blocks:
        return []
    shown = ", ".join(f"{value:g}" for value in classes[:6]) + (", ..." if len(classes) > 6 else "")
    said = (
        f"every batch checked at the last {len(run)} logging steps held a single class (`{path}`: {shown}, in turn): "
        f"the training set is sorted by class and not shuffled, so the model learns that every sample is of the "
        f"current batch's class and forgets the others; shuffle it (`DataLoader(..., shuffle=True)`)."
    )
    return [Evidence("input_scale", ("root",), float(len(classes)), 2.0, said, step=run[0][0], group="unshuffled")]

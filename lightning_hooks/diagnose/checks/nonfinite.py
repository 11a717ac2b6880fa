"""The check for NaN/Inf: the first layer to hold them, in the forward or the backward, or the loss."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_hooks.core.select import label
from lightning_hooks.diagnose.checks.snapshot import (
    SHOWN_LAYERS,
    Evidence,
    Snapshot,
    Thresholds,
    listed,
)
from lightning_hooks.stats.state import State

__all__ = ["nonfinite"]


def nonfinite(snap: Snapshot, limits: Thresholds) -> list[Evidence]:
    """NaN/Inf in a layer's output (the first to hold them, a module that runs more than once counted at its last
    call: a module run twice, an activation or a dropout, passes on what the layers before it made far more often
    than it makes NaN/Inf; said to come from its weights when they are NaN/Inf too, written by an earlier step),
    else in a parameter gradient (the layer nearest the output: the backward made them there and every layer before
    it gets them; not with the step's loss NaN/Inf, which made them), or in a step's loss.

    Gradients that a ``GradScaler`` found overflowing, and skipped, are fp16 loss scaling at work while its scale
    stays at least 1 (``snap.skipped_at_scale``): it halves the scale and goes on. Below 1 they overflow unscaled.
    A ``NonFiniteGuard`` finding in the same Trainer (``snap.guard``) is named first. A model whose float16 weights
    an optimizer steps with an ``eps`` that float16 rounds to 0 (``snap.eps_lost``: Adam's 1e-8) is told so: every
    weight whose gradient is exactly zero then gets 0 / 0. An output's Inf, with no NaN and a finite loss and
    gradients, is not named: it is a mask (logits of invalid actions filled with ``-inf``) that the loss handles.
    """
    bad_losses = [step for step, loss in snap.losses if not math.isfinite(loss)]
    scale = snap.skipped_at_scale
    routine = scale is not None and scale >= 1  # fp16 loss scaling at work
    # An output's Inf (or a square above float32's range) with a finite loss and gradients is a mask: invalid
    # actions or classes filled with -inf, or the dtype's lowest value, before a softmax that makes them 0.
    spread = bad_losses or any(s.nonfinite for s in snap.grads.values())
    # A layer's output, or its units after the functional operations that took it to the next layer (log, division)
    after = {n for n in snap.activated if _nonfinite_units(snap.units.get(n, ()), bool(spread))}
    outputs = [
        name
        for name, state in ((n, snap.activations.get(n)) for n in snap.order)
        if state is not None and (state.nonfinite > 0 and (spread or _has_nan(state)) or name in after)
    ]
    # in the order their last calls ran: a module that runs twice (a ResNet block's one ReLU, after its first
    # convolution and after the sum) holds the NaN of its last call, made by the layers that ran in between
    outputs.sort(key=lambda name: snap.last_calls.get(name, math.inf))
    # The backward runs from the loss: what it made NaN/Inf in a layer, every layer before it gets. With the step's
    # loss NaN/Inf, the loss made them.
    grads = [
        name
        for name in reversed(snap.order)
        if name in snap.grads and snap.grads[name].nonfinite > 0 and not routine and snap.step not in bad_losses
    ]
    if outputs:
        layers, count = outputs, float(len(outputs))
        made = (
            f" after `{snap.activated[layers[0]]}` (in forward)"
            if layers[0] in after and not snap.activations[layers[0]].nonfinite
            else ""
        )
        said = (
            f"the output of `{label(layers[0])}`{made} holds NaN/Inf values (the first of {len(layers)} to hold them)"
        )
        spoilt = [name for name in snap.order if not math.isfinite(snap.weights.get(name, 0.0))]
        if spoilt:  # its own, or those of a layer it shares them with (a tied embedding and output layer)
            whose = "its weights" if layers[0] in spoilt else f"the weights of {listed(spoilt)}"
            said += (
                f", and so do {whose}: an optimizer step before this one applied NaN/Inf gradients to them, and "
                "every output since carries them (the finding's first step is the first whose loss was NaN/Inf)"
            )
    elif grads:
        layers, count = grads, float(len(grads))
        said = (
            f"the parameter gradient of `{label(layers[0])}` holds NaN/Inf values (the nearest the output of "
            f"{len(layers)}) while every layer's output was finite: the backward made them in `{label(layers[0])}` or "
            f"between it and the next layer"
        )
        if scale is not None:
            said += f", and the GradScaler's skips have brought its scale down to {scale:.3g}: they overflow unscaled"
    elif bad_losses or snap.guard is not None:
        count = float(len(bad_losses))
        layers = [] if snap.guard else list(snap.executed[-1:])  # the output layer: the loss is computed from it
        said = (
            f"the training loss was NaN/Inf at {len(bad_losses)} step(s) from step {bad_losses[0]} while every "
            f"layer's output was finite: the loss of the output of `{label(layers[0]) if layers else 'root'}` "
            f"(a log or division of a value that reached 0)"
            if bad_losses
            else "a layer made NaN/Inf values"
        )
    else:
        return []
    named = [label(n) for n in layers]
    note = ""
    if snap.guard is not None:
        layer, step, line = snap.guard
        named = [layer, *(n for n in named if n != layer)]
        note = f" `NonFiniteGuard` found at step {step}: {line}."
    first = min([*bad_losses, *([snap.guard[1]] if snap.guard else [])], default=None)
    if lost := [name for name in snap.order if name in snap.eps_lost]:
        dtype, eps = snap.half[lost[0]][0], snap.eps[lost[0]]
        said += (
            f"; the optimizer steps {dtype} weights with an eps ({eps:.0e}) that {dtype} rounds to 0, so it divides 0 "
            f"by 0 for every weight whose gradient is exactly zero (an embedding's unused rows) and makes it NaN. Set "
            f'the optimizer\'s eps to 1e-4 or more, or keep float32 weights (`precision="16-mixed"`).{note}'
        )
    else:
        said += (
            "; add `NonFiniteGuard()` to name the operation that made them, and look for a division by zero, a log or "
            f"sqrt of a non-positive number, or an overflow.{note}"
        )
    return [Evidence("nonfinite", tuple(named[:SHOWN_LAYERS]) or ("root",), count, 0.0, said, step=first)]


def _nonfinite_units(sums: Sequence[float], spread: bool) -> bool:
    """Whether per-unit sums of squares hold a NaN, or an Inf while the loss or a gradient is NaN/Inf too (an Inf
    alone is a mask)."""
    return any(math.isnan(v) or (spread and math.isinf(v)) for v in sums)


def _has_nan(state: State) -> bool:
    """Whether a NaN is among the values behind ``state`` (its sums are NaN; an Inf alone makes them Inf)."""
    return math.isnan(state.sum_sq) or math.isnan(state.abs_sum)

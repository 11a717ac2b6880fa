"""Checks for a run that does not learn at all: no gradient, no backward, no optimizer step."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_hooks.core.select import label
from lightning_hooks.diagnose.checks.snapshot import (
    SHOWN_LAYERS,
    Evidence,
    Snapshot,
    Thresholds,
    listed,
)

__all__ = ["cut_off", "zero_loss", "no_learning", "STEPLESS", "stepless", "no_backward"]


def cut_off(layers: Sequence[str], step: int) -> Evidence:
    """Layers that run in the forward and are in an optimizer, but got no gradient at two logging steps and did not
    change in between (:meth:`HealthTracker._cut_off`): their output does not reach the loss through autograd."""
    one = len(layers) == 1
    said = listed(layers) + (
        f" {'runs' if one else 'run'} in the forward, but {'gets' if one else 'get'} no gradient and never "
        f"{'changes' if one else 'change'}: {'its' if one else 'their'} output is cut from the loss's graph (a "
        f"`.detach()`, `.item()` or `.numpy()`, `torch.tensor(...)` of a tensor, or `torch.no_grad()` inside forward, "
        f"on the way to the loss); if {'it is' if one else 'they are'} meant to stay frozen, set `requires_grad=False`."
    )
    return Evidence("no_learning", tuple(label(n) for n in layers[:SHOWN_LAYERS]), 0.0, 0.0, said, step)


def zero_loss(snap: Snapshot) -> bool:
    """Whether the logging step's own loss was exactly zero (a hinge or margin loss met by every sample)."""
    return any(step == snap.step and loss == 0 for step, loss in snap.losses)


def no_learning(snap: Snapshot, limits: Thresholds, zero_from_start: bool = False) -> list[Evidence]:
    """Every parameter gradient exactly zero: nothing learns. Named after the output layer, where the gradient
    should have entered. Not when the step's loss is exactly zero too: a hinge or margin loss whose batch meets
    every margin has nothing left to learn from it; unless the loss was exactly zero at every step from step 0
    (``zero_from_start``), before the model learnt anything: a loss weighted by 0, or one comparing the output with
    itself."""
    grads = [s for s in snap.grads.values() if s.numel]
    if not snap.gradless and (not grads or any(s.abs_sum != 0 or s.nonfinite for s in grads)):
        return []
    layers = tuple(label(n) for n in snap.executed[-1:]) or ("root",)
    if zero_loss(snap):
        if not zero_from_start:
            return []
        said = (
            f"the loss was exactly 0 at every step from step 0 to step {snap.step}, before the model learnt anything, "
            f"so every gradient is zero and nothing learns: look for a loss weighted by 0, one that compares the "
            f"output with itself, or a mask that leaves out every element."
        )
        return [Evidence("no_learning", layers, 0.0, 0.0, said, step=0)]
    look = (
        "look for"
        if snap.automatic
        else "under manual optimization, look first for `optimizer.zero_grad()` called between "
        "`self.manual_backward(loss)` and `optimizer.step()`, or `optimizer.step()` before "
        "`self.manual_backward(loss)` (the step gets cleared gradients); then for"
    )
    said = (
        f"every parameter gradient is exactly zero or missing at step {snap.step}: nothing learns; {look} an "
        f"activation over one unit (a softmax over a single output is always 1), a detached tensor (`.detach()`, "
        f"`.item()`, `torch.no_grad()` inside forward) or a loss that does not depend on the model's output."
    )
    return [Evidence("no_learning", layers, 0.0, 0.0, said)]


STEPLESS = 100
"""Training batches in a row with no optimizer step (under manual optimization) before ``no_learning`` names it."""


def stepless(batches: int, step: int) -> Evidence:
    """No optimizer step in ``batches`` training batches in a row, the global step staying at ``step``: under manual
    optimization, ``optimizer.step()`` is never called, and the weights never change."""
    said = (
        f"no optimizer step ran in the last {batches} training batches (the global step stayed at {step}), so the "
        f"weights never change: under manual optimization, call `optimizer.step()` after `self.manual_backward(loss)` "
        f"(`optimizer = self.optimizers()`), once per batch or once per batches accumulated."
    )
    return Evidence("no_learning", ("root",), float(batches), float(STEPLESS), said, step)


def no_backward(snap: Snapshot, since: int) -> Evidence:
    """No backward pass and no gradient at any step from ``since`` to the logging step: the optimizer steps with no
    gradient, and nothing learns. Named after the output layer, like :func:`no_learning`."""
    if snap.automatic:
        fix = (
            "`training_step` returned `None`, and Lightning skips the backward of such a step (the way to skip a "
            'batch on purpose); return the loss, or a dict with a `"loss"` key'
        )
    else:
        fix = "under manual optimization, call `self.manual_backward(loss)` before `optimizer.step()`"
    said = (
        f"no backward pass ran at any step from step {since} to step {snap.step}, so no parameter gets a gradient and "
        f"nothing learns: {fix}."
    )
    return Evidence("no_learning", tuple(label(n) for n in snap.executed[-1:]) or ("root",), 0.0, 0.0, said, since)

"""Small facts about autograd and loss scaling that hooks need (pure torch)."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread.

    Activation checkpointing re-runs ``forward`` (and so forward hooks) during backward;
    ``torch.is_grad_enabled()`` cannot tell that recompute apart, the graph task id can. While
    dynamo traces a forward the answer is ``False``: the graph task id cannot be traced, and a
    compiled forward is not re-run by autograd.
    """
    if torch.compiler.is_compiling():
        return False
    return bool(torch._C._current_graph_task_id() != -1)


graph_task_id = torch._C._current_graph_task_id
"""The id of the backward pass autograd runs on this thread, ``-1`` outside one; prefer :func:`in_backward`."""


def loss_scale(scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """The current scale of an enabled ``GradScaler`` as the tensor on device (``None`` without one).

    Gradients produced in backward carry this factor until the scaler unscales them; dividing or
    bounding by the tensor needs no host synchronisation. ``None`` too before the scaler's first
    ``scale()`` call, when no gradient can carry a scale yet.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    scale: torch.Tensor | None = getattr(scaler, "_scale", None)
    return scale


def dense_gradient(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a strided tensor: a sparse gradient (``nn.Embedding(sparse=True)``'s) in its dense form, zeros
    included, which statistics and norms read (their kernels take no sparse tensor); any other as it is."""
    return grad if grad.layout == torch.strided else grad.to_dense()

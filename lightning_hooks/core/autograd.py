"""Small facts about autograd and loss scaling that hooks need (pure torch)."""

from __future__ import annotations

import torch

__all__ = ["dense_gradient", "graph_task_id", "in_backward", "in_transform", "loss_scale"]


graph_task_id = torch._C._current_graph_task_id
"""The id of the backward pass autograd runs on this thread, ``-1`` outside one; prefer :func:`in_backward`."""


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (activation checkpointing re-running
    ``forward``); ``False`` while dynamo traces."""
    return not torch.compiler.is_compiling() and graph_task_id() != -1


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``...) is running: its tensors are wrappers
    without storage, whose values a hook cannot read (per-sample gradients, as in DP-SGD)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def loss_scale(scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """The current scale of an enabled ``GradScaler`` as the tensor on device, which gradients carry until the
    scaler unscales them; ``None`` without one or before its first ``scale()`` call."""
    return getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None


def dense_gradient(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a strided tensor: a sparse one (``nn.Embedding(sparse=True)``'s) in dense form, zeros included."""
    return grad if grad.layout == torch.strided else grad.to_dense()

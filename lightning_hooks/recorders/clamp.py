"""Clamping gradients to ``[-value, value]`` in true (unscaled) units (pure torch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from lightning_hooks.core.autograd import in_backward, loss_scale
from lightning_hooks.core.handles import HookHandles
from lightning_hooks.core.shards import counted_part, is_sharded, local, replica_part, summed
from lightning_hooks.stats.state import counted, flat_pieces, real_view

__all__ = ["GradClamper"]


class ClampCount:
    """How many gradient elements were clamped while ``active``, counted on device."""

    def __init__(self) -> None:
        self.active = False
        self.clamped: list[torch.Tensor] = []
        self.seen = 0

    def reset(self) -> None:
        self.active, self.clamped, self.seen = False, [], 0

    def fraction(self, pool: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float | None:
        """The clamped share of the elements seen (``None`` if none were), pooled by ``pool``, a sum over processes
        that each saw their own shard (every process must call this then); resets the count."""
        clamped, seen = self.clamped, self.seen
        self.reset()
        if pool is None:
            return torch.stack(clamped).sum().item() / seen if seen else None
        here = torch.stack(clamped).sum().double() if clamped else torch.zeros((), dtype=torch.float64)
        counts = torch.stack([here, torch.tensor(float(seen), dtype=torch.float64, device=here.device)])
        total_clamped, total_seen = pool(counts).tolist()
        return total_clamped / total_seen if total_seen else None


def count_above(t: torch.Tensor, bound: float) -> torch.Tensor:
    """How many values of ``t`` are above ``bound`` in magnitude (NaN is not), counted on device."""
    magnitude = t.detach().abs()
    return counted(torch.gt(magnitude, bound, out=magnitude), None)


def clamp_true_gradient(
    grad: torch.Tensor, value: float, scale: torch.Tensor | None, count: ClampCount | None = None
) -> torch.Tensor:
    """``grad``, carrying the loss ``scale`` (or none), clamped to ``[-value, value]`` in true units; under a scale its
    non-finite values stay, for the ``GradScaler`` to skip the step. A sparse (COO) gradient's values are clamped; a
    complex one's real and imaginary parts, each (torch's optimizers take a complex parameter for two real ones)."""
    if grad.is_complex():
        return torch.view_as_complex(clamp_true_gradient(real_view(grad), value, scale, count))
    if grad.layout == torch.sparse_coo:  # an embedding's with `sparse=True`
        grad = grad.coalesce()
        clamped = clamp_true_gradient(grad.values(), value, scale, count)
        if count is not None and count.active:
            count.seen += grad.numel() - grad.values().numel()
        # From a coalesced tensor's own indices: valid, so the invariant checks (and their warning) are skipped. torch
        # 2.11 warns they are "implicitly disabled" even with `check_invariants=False`, but not inside this context.
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            return torch.sparse_coo_tensor(grad.indices(), clamped, grad.shape, is_coalesced=True)
    if scale is None:
        if count is not None and count.active:
            count.clamped.append(count_above(grad, value))
            count.seen += grad.numel()
        return grad.clamp(-value, value)
    bound = (scale * value).to(grad.dtype)
    if count is not None and count.active:
        count.clamped.append((grad.abs() > bound).logical_and(torch.isfinite(grad)).sum())
        count.seen += grad.numel()
    return torch.where(torch.isfinite(grad), torch.clamp(grad, -bound, bound), grad)


class GradClamper:
    """Clamp parameter gradients in backward (:meth:`attach`: a tensor hook on each parameter, the bound times the
    scale of ``scaler`` if one scales the loss) or once accumulated (:meth:`clamp_accumulated`); ``count`` counts
    clamped elements while active.

    Example::

        >>> layer = nn.Linear(2, 1)
        >>> with HookHandles() as handles:
        ...     GradClamper(0.1).attach([layer.weight], handles)
        ...     (100 * layer(torch.ones(1, 2))).sum().backward()
        >>> layer.weight.grad
        tensor([[0.1000, 0.1000]])
    """

    def __init__(self, value: float, scaler: torch.amp.GradScaler | None = None) -> None:
        self.value, self.scaler = value, scaler
        self.count = ClampCount()
        self.unsharded: set[int] = set()
        """Ids of the unsharded parameters hooked in this step (FSDP2, see :meth:`attach_unsharded`)."""
        self.counts_plain = True
        """Whether this process counts the clamped elements of plain (not ``DTensor``) gradients: under tensor
        parallelism every rank of a group holds the same one, and only the group's first counts it."""

    def attach(self, params: Sequence[nn.Parameter], handles: HookHandles) -> None:
        for param in params:
            handles.add(param.register_hook(_ClampHook(self)))

    def attach_backward(self, loss: torch.Tensor, params: Sequence[nn.Parameter], handles: HookHandles) -> None:
        """Clamp what the coming backward pass of ``loss`` gives ``params`` (without a scaler): every ``.grad`` in place
        as the pass ends if none is set yet, else through :meth:`attach`'s hooks. Remove ``handles`` after the pass."""
        if not loss.requires_grad:
            return
        if any(param.grad is not None for param in params):
            self.attach(params, handles)
        else:
            handles.add(loss.register_hook(_AtBackwardEnd(self, params)))

    def clamp_grads(self, params: Sequence[nn.Parameter]) -> None:
        """Clamp the ``.grad`` of ``params`` in place to ``[-value, value]`` (unscaled), counting while active."""
        self._clamp_in_place([grad for param in params if (grad := param.grad) is not None])

    def attach_unsharded(
        self,
        modules: Sequence[tuple[str, nn.Module]],
        params: Sequence[nn.Parameter],
        handles: HookHandles,
        step_handles: HookHandles,
    ) -> None:
        """Clamp the unsharded gradients of the sharded ``params`` (FSDP2) of ``modules`` before the reduce-scatter:
        pre-hooks in ``handles`` hook them into ``step_handles``; remove those, clear :attr:`unsharded` each step."""
        wanted = {id(p) for p in params}
        for _, module in modules:
            names = [name for name, p in module.named_parameters(recurse=False) if id(p) in wanted]
            if names:
                handles.add(module.register_forward_pre_hook(_ClampUnsharded(self, names, wanted, step_handles)))

    def clamp_accumulated(self, params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        """Clamp in place the ``.grad`` of those ``params`` that ``optimizer`` will use (unscaled by now); a sharded one
        shard by shard, the count then being this process's, to pool."""
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        grads = [p.grad for p in params if p.grad is not None and id(p) in in_optimizer]
        if not any(is_sharded(g) for g in grads):
            self._clamp_in_place(grads)
        else:  # every copy of a shard is clamped, and counted once over the processes (a plain one on rank zero)
            counted = [counted_part(g) if is_sharded(g) else replica_part(g) for g in grads]
            self._clamp_in_place([local(g) for g in grads], counted)

    def _clamp_in_place(self, grads: list[torch.Tensor], counted: list[torch.Tensor] | None = None) -> None:
        """Clamp ``grads`` in place, counting the clamped elements (of ``counted``, the parts of ``grads`` this
        process counts, if given) while :attr:`count` is active."""
        value, count = self.value, self.count
        strided = torch.strided  # a singleton: `is` keeps this every-step loop cheap
        unusual = [grad for grad in grads if grad.layout is not strided or grad.is_complex()]
        dense, sparse = grads, unusual
        if unusual:  # a complex gradient is clamped in place through a real view: real and imaginary parts each
            dense = [real_view(grad) for grad in grads if grad.layout is strided]
            counted = None if counted is None else [real_view(grad) for grad in counted]
            sparse = [grad for grad in unusual if grad.layout is not strided]
        with torch.no_grad():
            if count.active:
                seen = dense if counted is None else [grad for grad in counted if grad.layout is strided]
                count.clamped += [count_above(piece, value) for piece in flat_pieces(seen)]
                count.seen += sum(grad.numel() for grad in seen)
            if dense:  # every gradient sparse (embeddings under SparseAdam): no dense one to clamp
                torch._foreach_clamp_min_(dense, -value)
                torch._foreach_clamp_max_(dense, value)
            for grad in sparse:  # no fused kernel
                grad.copy_(clamp_true_gradient(grad, value, None, count))


class _ClampUnsharded:
    """Forward pre-hook under FSDP2: clamp the gradients of the module's unsharded parameters."""

    def __init__(self, clamper: GradClamper, names: list[str], sharded: set[int], handles: HookHandles) -> None:
        self.clamper, self.names, self.sharded, self.handles = clamper, names, sharded, handles

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if in_backward():  # activation checkpointing re-running forward: hooked already
            return
        hooked = self.clamper.unsharded
        for name in self.names:
            # While the module runs, FSDP has put its unsharded parameter in the sharded one's place (a DTensor
            # still, of the tensor-parallel mesh, under tensor parallelism).
            param = getattr(module, name)
            if id(param) not in self.sharded and param.requires_grad and id(param) not in hooked:
                hooked.add(id(param))
                self.handles.add(param.register_hook(_ClampHook(self.clamper)))


class _AtBackwardEnd:
    """Tensor hook on a loss: once the backward pass it starts has computed every gradient, clamp ``params``'."""

    def __init__(self, clamper: GradClamper, params: Sequence[nn.Parameter]) -> None:
        self.clamper, self.params = clamper, params

    def __call__(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(partial(self.clamper.clamp_grads, self.params))


class _ClampHook:
    def __init__(self, clamper: GradClamper) -> None:
        self.clamper = clamper

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        clamper = self.clamper
        scale = None if clamper.scaler is None else loss_scale(clamper.scaler)
        if is_sharded(grad):  # tensor parallelism
            return _clamp_parts(grad, clamper.value, scale, clamper.count)
        return clamp_true_gradient(grad, clamper.value, scale, clamper.count if clamper.counts_plain else None)


def _clamp_parts(grad: torch.Tensor, value: float, scale: torch.Tensor | None, count: ClampCount) -> torch.Tensor:
    """A ``DTensor`` gradient clamped in its parts, each element counted once over the processes of its mesh. A part
    still to be summed over some ranks (``Partial``: a replicated norm's weight under sequence parallelism) is summed
    first, a collective that every rank's backward reaches at the same point; clamping a part of a sum would not be
    clamping the gradient."""
    from torch.distributed.tensor import DTensor

    grad = summed(grad)
    mesh, placements = grad.device_mesh, grad.placements  # type: ignore[attr-defined]
    if count.active:  # each process's gradient is its own batch's: copies off the mesh count (copies_off_mesh=False)
        clamp_true_gradient(counted_part(grad, copies_off_mesh=False), value, scale, count)
    clamped = clamp_true_gradient(local(grad), value, scale)
    return DTensor.from_local(clamped, mesh, placements, shape=grad.shape, stride=grad.stride())

"""Recording gradient statistics: layer output gradients, parameter gradients, update ratios (pure torch)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.core.autograd import dense_gradient, graph_task_id, loss_scale
from lightning_hooks.core.compiled import Pending, Region, Switched
from lightning_hooks.core.handles import HookHandles, made_once
from lightning_hooks.core.nested import named_tensors
from lightning_hooks.core.shards import counted_part, is_sharded, replica_part
from lightning_hooks.stats.batch import Key, OutputKeys, StatBatch
from lightning_hooks.stats.state import State

__all__ = ["OutputGradRecorder", "ParamGradRecorder", "gradient_norms", "update_ratio"]


class OutputGradRecorder:
    """Observe the gradient with respect to each output of the hooked modules, under ``("out", <layer>)``.

    A forward hook has each output's gradient read in backward, also when the output is modified in
    place afterwards (``ReLU(inplace=True)``). Under an enabled ``GradScaler`` the gradient is divided
    by the current scale. ``fired`` collects the names of the modules whose forward hook ran.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
        >>> batch = StatBatch()
        >>> batch.start()
        >>> with HookHandles() as handles:
        ...     OutputGradRecorder(batch).attach([("0", model[0])], handles)
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> sorted(batch.fetch().states)
        [('out', '0')]
    """

    def __init__(
        self, batch: StatBatch, scaler: torch.amp.GradScaler | None = None, fired: set[str] | None = None
    ) -> None:
        self.batch, self.scaler = batch, scaler
        self.fired = set() if fired is None else fired
        self.keys = OutputKeys("out")
        self.forward_keys = OutputKeys("fwd")
        self.prepend = False
        """Hook before the module's other forward hooks (see :attr:`ActivationRecorder.prepend`) and keep each output's
        state under ``("fwd", <layer>)``: under tensor parallelism, what tells a replicated output from a shard."""
        self._hooks: dict[str, _OutputGradHook] = {}

    def attach(self, modules: Sequence[tuple[str, nn.Module]], handles: HookHandles) -> None:
        hooks = made_once(self._hooks, modules, lambda name, _: _OutputGradHook(self, name))
        handles.add_forward_hooks(hooks, prepend=self.prepend)

    def attach_switched(
        self, modules: Sequence[tuple[str, nn.Module, Region]], handles: HookHandles, pending: Pending
    ) -> None:
        """Hook modules inside compiled regions for a whole fit: while the region's switch is on, each tensor of a bare
        or flat tuple, list or dict output passes through ``grad_probe``, whose backward hands the gradient here."""
        for name, module, region in modules:
            region.settles(pending)
            slot = handles.add(RemovableHandle(_READERS))
            _READERS[slot.id] = _PathReader(self, name)
            probe = _OutputGradProbe(str(slot.id))
            handles.add(module.register_forward_hook(Switched(region.switch, _Fired(pending, name, probe))))


class _OutputGradHook:
    def __init__(self, recorder: OutputGradRecorder, name: str) -> None:
        self.recorder, self.name = recorder, name
        self.reader = _GradReader(recorder, recorder.keys.eager(name, ""))  # for a bare tensor output
        self.first = _OutputOf(self.reader, 0)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor | None:
        if graph_task_id() != -1:  # activation checkpointing re-running forward (an eager hook: see in_backward)
            return None
        self.recorder.fired.add(self.name)
        if not torch.is_grad_enabled():
            return None
        if type(output) is torch.Tensor and not self.recorder.prepend:  # what most modules return
            if output.requires_grad and output.is_floating_point():
                if args and output is args[0] and not getattr(module, "inplace", False):
                    # A pass-through (`nn.Identity`, a ResNet's shortcut) returns the tensor its input's other users
                    # share: its callers get a view, whose gradient is theirs alone (torch's backward hooks do so).
                    view = output.view_as(output)
                    view.grad_fn.register_prehook(self.first)
                    return view
                node = output.grad_fn
                if node is not None and output.output_nr == 0:
                    node.register_prehook(self.first)
                else:
                    _read_grad(output, self.reader)
            return None
        recorder = self.recorder
        for path, tensor in named_tensors(output):
            if tensor.requires_grad and tensor.is_floating_point():
                _read_grad(tensor, _GradReader(recorder, recorder.keys.key(self.name, path)))
                if recorder.prepend:
                    recorder.batch.add(recorder.forward_keys.key(self.name, path), tensor)
        return None


def _read_grad(output: torch.Tensor, reader: _GradReader) -> None:
    """Have ``reader`` called with the gradient with respect to ``output`` in backward."""
    node = output.grad_fn
    if node is None:  # a leaf returned as it is (a parameter)
        output.register_hook(reader)
    else:  # a pre-hook of the node that made the output
        node.register_prehook(_OutputOf(reader, output.output_nr))


class _GradReader:
    def __init__(self, recorder: OutputGradRecorder, key: Key) -> None:
        self.recorder, self.key = recorder, key

    def __call__(self, grad: torch.Tensor) -> None:
        recorder = self.recorder
        scale = None if recorder.scaler is None else loss_scale(recorder.scaler)
        recorder.batch.add(self.key, grad if scale is None else grad.float() / scale)


class _OutputOf:
    """A pre-hook of the autograd node that made an output: hands that output's gradient (what a tensor hook
    on it would get) to ``reader``, if the node received one."""

    def __init__(self, reader: _GradReader, index: int) -> None:
        self.reader, self.index = reader, index

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        grad = grad_outputs[self.index]
        if grad is not None:
            self.reader(grad)


class _PathReader:
    """Hands the gradient of output ``path`` of module ``name`` to the recorder (called in backward)."""

    def __init__(self, recorder: OutputGradRecorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def __call__(self, path: str, grad: torch.Tensor) -> None:
        _GradReader(self.recorder, self.recorder.keys.key(self.name, path))(grad)


_READERS: OrderedDict[int, _PathReader] = OrderedDict()
"""The readers that ``grad_probe``'s backward calls, by slot; a slot's ``RemovableHandle`` frees it."""


@torch.library.custom_op("lightning_hooks::grad_probe", mutates_args=())
def _grad_probe(x: torch.Tensor, slot: str, path: str) -> torch.Tensor:
    """The identity (a copy: a custom operator returns no alias of its input); see :func:`_grad_read`."""
    return x.clone()


@torch.library.custom_op("lightning_hooks::grad_read", mutates_args=())
def _grad_read(grad: torch.Tensor, slot: str, path: str) -> torch.Tensor:
    """``grad_probe``'s backward: give ``grad`` to the reader of ``slot``, if it is still there. The slot is a
    string, not an int: dynamo would make an int that differs between hooks a symbolic input of the graph."""
    reader = _READERS.get(int(slot))
    if reader is not None:
        reader(path, grad)
    return grad.clone()


@_grad_probe.register_fake
def _grad_probe_fake(x: torch.Tensor, slot: str, path: str) -> torch.Tensor:
    return torch.empty_like(x)


@_grad_read.register_fake
def _grad_read_fake(grad: torch.Tensor, slot: str, path: str) -> torch.Tensor:
    return torch.empty_like(grad)


def _probe_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.slot, ctx.path = inputs[1], inputs[2]


def _probe_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return torch.ops.lightning_hooks.grad_read(grad, ctx.slot, ctx.path), None, None


_grad_probe.register_autograd(_probe_backward, setup_context=_probe_setup)

_FLAT_OUTPUTS = (tuple, list, dict)


class _Fired:
    """Notes in ``pending`` that module ``name`` ran, then calls ``hook``."""

    def __init__(self, pending: Pending, name: str, hook: _OutputGradProbe) -> None:
        self.pending, self.name, self.hook = pending, name, hook

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        self.pending.fired.append(self.name)
        return self.hook(output)


class _OutputGradProbe:
    """Passes each output tensor that will receive a gradient through ``grad_probe`` (inside compiled code)."""

    def __init__(self, slot: str) -> None:
        self.slot = slot

    def __call__(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        if isinstance(output, torch.Tensor):
            return self._probe("", output)
        if type(output) in _FLAT_OUTPUTS:
            items = output.items() if isinstance(output, dict) else enumerate(output)
            probed = {k: self._probe(str(k), v) if isinstance(v, torch.Tensor) else v for k, v in items}
            return probed if isinstance(output, dict) else type(output)(probed.values())
        return None

    def _probe(self, path: str, t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad and t.is_floating_point():
            return torch.ops.lightning_hooks.grad_probe(t, self.slot, path)
        return t


class ParamGradRecorder:
    """Observe parameter gradients under ``("param", <name>)`` and update ratios under ``("ratio", <name>)``.

    :meth:`record`, called where the optimizer is about to step, reads each gradient ``optimizer`` will
    use, once per recorded step (:meth:`start`); with ``update_ratio`` the optimizer's step post-hook
    adds ``||w_after - w_before|| / ||w_before||``. A sharded parameter (FSDP2) is read through this
    process's shard, to be pooled across processes (groups ``param``, ``update``, ``weight``): its
    ratio is then :func:`update_ratio` of ``("update", <name>)`` and ``("weight", <name>)``.

    Example::

        >>> layer = nn.Linear(3, 2)
        >>> optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        >>> layer(torch.ones(1, 3)).sum().backward()
        >>> batch = StatBatch()
        >>> batch.start()
        >>> with HookHandles() as handles:
        ...     ParamGradRecorder(batch, update_ratio=True).record(list(layer.named_parameters()), optimizer, handles)
        ...     optimizer.step()
        >>> fetched = batch.fetch()
        >>> sorted(fetched.states), sorted(fetched.scalars)
        ([('param', 'bias'), ('param', 'weight')], [('ratio', 'bias'), ('ratio', 'weight')])
    """

    def __init__(
        self,
        batch: StatBatch,
        histograms: bool = False,
        update_ratio: bool = False,
        weight_norms: bool = False,
        observe: bool = True,
        changed_shares: bool = False,
    ) -> None:
        self.batch, self.histograms, self.update_ratio = batch, histograms, update_ratio
        self.weight_norms = weight_norms
        """Also keep ``||w_before||`` of each parameter with an update ratio, under ``("wnorm", <name>)``."""
        self.changed_shares = changed_shares
        """Also keep the share of the values the step changed of each half-precision parameter with an update ratio,
        under ``("changed", <name>)``: an update below half the spacing of its numbers rounds to no change."""
        self.observe = observe
        """Observe the gradients (``False``: only the update ratios, for a caller that reads gradients its way)."""
        self.pooled = False
        """Whether the gradients' states are pooled over processes (see :meth:`record`)."""
        self._read: set[int] = set()

    def start(self) -> None:
        """A new recorded step: every parameter may be read again."""
        self._read = set()

    def record(
        self, params: Sequence[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer, handles: HookHandles
    ) -> None:
        """Read the gradients of ``params`` that ``optimizer`` will use; its update-ratio hook goes into ``handles``."""
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        read: list[tuple[str, nn.Parameter]] = []
        grads: list[torch.Tensor] = []
        for name, param in params:
            if param.grad is None or id(param) in self._read or id(param) not in in_optimizer:
                continue
            self._read.add(id(param))
            read.append((name, param))
            # Pooled over processes (some parameter is sharded), a plain parameter is one every process holds alike
            # (under tensor parallelism, a norm not parallelised): rank zero counts it.
            grad = counted_part(param.grad) if not self.pooled or is_sharded(param) else replica_part(param.grad)
            grads.append(grad if grad.layout == torch.strided else dense_gradient(grad))
        if not read:
            return
        if self.observe:
            self.batch.add_many([("param", name) for name, _ in read], grads, self.histograms)
        if self.update_ratio:
            hook = _UpdateRatio(self.batch, read, self.weight_norms, self.changed_shares)
            handles.add(optimizer.register_step_post_hook(hook))


class _UpdateRatio:
    """Optimizer step post-hook: ``||w_after - w_before|| / ||w_before||`` for each parameter it was given
    (a sharded one's change and weight as states, see :class:`ParamGradRecorder`). The parameters of one device,
    dtype and shape are copied and compared stacked, a few operators for each shape rather than for each parameter;
    those alone in their shape, with torch's foreach operators (a few for all of them)."""

    def __init__(
        self,
        batch: StatBatch,
        params: list[tuple[str, nn.Parameter]],
        weight_norms: bool = False,
        changed_shares: bool = False,
    ) -> None:
        self.batch, self.weight_norms, self.changed_shares = batch, weight_norms, changed_shares
        groups: dict[tuple[torch.device, torch.dtype, torch.Size], list[tuple[str, nn.Parameter]]] = {}
        self.sharded: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        with torch.no_grad():
            for name, p in params:
                if is_sharded(p):
                    self.sharded.append((name, p, counted_part(p).detach().clone()))
                else:
                    groups.setdefault((p.device, p.dtype, p.shape), []).append((name, p))
            alone: dict[tuple[torch.device, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
            for (device, dtype, _), group in groups.items():
                if len(group) == 1:
                    alone.setdefault((device, dtype), []).extend(group)
            self.before = [(group, _stacked(group)) for group in groups.values() if len(group) > 1]
            # their negated copies (foreach has no copy)
            self.alone = [(group, torch._foreach_neg([p for _, p in group])) for group in alone.values()]

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        before, self.before = self.before, []  # the copies are freed as soon as the ratios are taken
        alone, self.alone = self.alone, []
        sharded, self.sharded = self.sharded, []
        for name, param, old in sharded:  # a shard's part of the norms: pooled across processes at the fetch
            self.batch.add(("update", name), counted_part(param).detach() - old)
            self.batch.add(("weight", name), old)
        if not before and not alone:
            return
        changes, scales, shares, halves = [], [], [], []
        with torch.no_grad():
            for group, old in before:
                change = _stacked(group).sub_(old)
                changes.append(_norms(change))
                scales.append(_norms(old))
                if self.changed_shares and old.dtype in _HALF:
                    shares.append(change.ne(0).sum(1) / change.shape[1])
                    halves += [name for name, _ in group]
            for group, minus_old in alone:
                each = torch._foreach_add([p for _, p in group], minus_old)
                changes.append(_foreach_norms(each))
                scales.append(_foreach_norms(minus_old))
                if self.changed_shares and minus_old[0].dtype in _HALF:
                    shares.append(torch.stack([c.ne(0).sum() / c.numel() for c in each]))
                    halves += [name for name, _ in group]
            change, scale = torch.cat(changes).double(), torch.cat(scales).double().clamp_min_(1e-12)
        names = [name for group, _ in [*before, *alone] for name, _ in group]
        self.batch.add_scalars([("ratio", name) for name in names], change / scale)
        if self.weight_norms:
            self.batch.add_scalars([("wnorm", name) for name in names], scale)
        if halves:
            self.batch.add_scalars([("changed", name) for name in halves], torch.cat(shares))


_HALF = (torch.float16, torch.bfloat16)


def _stacked(group: list[tuple[str, nn.Parameter]]) -> torch.Tensor:
    """The values of parameters of one shape, one row each (a copy)."""
    return torch.stack([p for _, p in group]).reshape(len(group), group[0][1].numel())  # under no_grad


def _norms(rows: torch.Tensor) -> torch.Tensor:
    """The norm of each row, taken in float32 at least (a float16 norm overflows at 65,504)."""
    if rows.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)
    return torch.linalg.vector_norm(rows, dim=1)


def _foreach_norms(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The norm of each of ``tensors`` (of one dtype), taken in float32 at least."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32 if tensors[0].dtype in _HALF else None))


def update_ratio(update: State, weight: State) -> float:
    """``||Δw|| / ||w||`` from the pooled states of a sharded parameter's change and its weight before it."""
    return math.sqrt(max(update.sum_sq, 0.0)) / max(math.sqrt(max(weight.sum_sq, 0.0)), 1e-12)


def gradient_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[‖g‖₁ of each of grads, ‖g‖₂² of each]``, float32, on the gradients' device; a NaN or Inf gradient
    makes both of its norms non-finite.

    Example::

        >>> gradient_norms([torch.tensor([3.0, -4.0]), torch.tensor([1.0])]).tolist()
        [7.0, 1.0, 25.0, 1.0]
    """
    grads = list(grads)
    if grads and grads[0].device.type == "cpu":  # torch's CPU 1-norm is a scalar loop, 3x slower than |g| summed
        l1 = [g.abs().sum() for g in grads]
    else:
        l1 = list(torch._foreach_norm(grads, 1))
    l2 = torch._foreach_norm(grads, 2)
    return torch.cat([torch.stack(l1).float(), torch.stack(l2).float().square()])  # mixed dtypes stack promoted

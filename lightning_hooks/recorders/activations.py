"""Recording statistics of module outputs with forward hooks (pure torch)."""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_hooks.core.autograd import graph_task_id, in_backward
from lightning_hooks.core.compiled import Pending, Region, Switched
from lightning_hooks.core.handles import HookHandles, made_once
from lightning_hooks.core.nested import named_tensors
from lightning_hooks.core.shards import counted_part, is_sharded
from lightning_hooks.stats.batch import OutputKeys, StatBatch
from lightning_hooks.stats.state import input_sums

__all__ = ["ActivationRecorder", "UnitRecorder"]


class ActivationRecorder:
    """Observe every floating-point tensor each hooked module returns, into ``batch`` under ``("act", <layer>)``.

    Nested outputs are observed per tensor (``<layer>.out.<path>``); a module's calls pool under one key.
    ``fired`` collects the names of the modules whose hook ran. Checkpointing's recompute is not counted.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        >>> batch = StatBatch()
        >>> batch.start()
        >>> with HookHandles() as handles:
        ...     ActivationRecorder(batch).attach([("1", model[1])], handles)
        ...     _ = model(torch.ones(2, 4))
        >>> sorted(batch.fetch().states)
        [('act', '1')]
    """

    def __init__(self, batch: StatBatch, histograms: bool = False, fired: set[str] | None = None) -> None:
        self.batch, self.histograms = batch, histograms
        self.fired = set() if fired is None else fired
        self.keys = OutputKeys("act")
        self.prepend = False
        """Hook before the module's other forward hooks: under tensor parallelism, to see a parallelised module's
        output as the ``DTensor`` it made, before its parallel style turns it into a plain local tensor."""
        self._hooks: dict[str, _ActivationHook] = {}

    def attach(self, modules: Sequence[tuple[str, nn.Module]], handles: HookHandles) -> None:
        hooks = made_once(self._hooks, modules, lambda name, _: _ActivationHook(self, name, self.batch))
        handles.add_forward_hooks(hooks, prepend=self.prepend)

    def attach_switched(
        self, modules: Sequence[tuple[str, nn.Module, Region]], handles: HookHandles, pending: Pending
    ) -> None:
        """Hook modules inside compiled regions for a whole fit: each hook runs while its region's switch
        is on and leaves its states in ``pending`` (see :mod:`lightning_hooks.core.compiled`)."""
        for name, module, region in modules:
            region.settles(pending)
            handles.add(module.register_forward_hook(Switched(region.switch, _ActivationHook(self, name, pending))))


class _ActivationHook:
    def __init__(self, recorder: ActivationRecorder, name: str, into: StatBatch | Pending) -> None:
        self.recorder, self.name, self.into = recorder, name, into
        self.key = recorder.keys.eager(name, "")  # for a bare tensor output

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        recorder, into = self.recorder, self.into
        # Not while activation checkpointing re-runs forward in backward.
        if isinstance(into, Pending):  # inside compiled code: see Pending
            if in_backward():
                return
            into.fired.append(self.name)
        else:
            if graph_task_id() != -1:  # an eager hook: no compiler traces it
                return
            recorder.fired.add(self.name)
        if type(output) is torch.Tensor:  # what most modules return
            if output.is_floating_point():
                into.add(self.key, output, recorder.histograms)
            return
        for path, tensor in named_tensors(output):
            if tensor.is_floating_point():
                into.add(recorder.keys.key(self.name, path), tensor, recorder.histograms)


class UnitRecorder:
    """Per output unit of a parameter-free hooked module's outputs of two or more dimensions, the sum of squares of
    its values (keys in :attr:`per_unit`); of any other output, its sum of squares.

    A unit is a channel of a map (``(N, C, H, W)``, ``(N, C, D, H, W)``, ``(N, C, L)`` out of 1-d convolutions and
    their norms) or a feature of anything else (``(N, F)``, ``(N, T, F)``). Each floating-point output is one vector
    under ``("units", <layer>[.out.<path>])``, pooled by ``+`` over calls, micro-batches and (fetched ``across``)
    processes; ``samples`` counts the values each unit of a key saw here since :meth:`start`, ``order`` the modules
    as they first ran, ``last_call`` when each ran last. A module that also runs on outputs of another width
    (SegFormer applies one dropout after two layers) has other units there: each other width gets a key of its own,
    ``<layer>.out.<path>[<width>]``. Sigmoid, tanh and softmax modules also count their saturated outputs (within
    0.1 % of their bounds; a softmax's rows by their largest value) under ``("sat", <layer>)``, out of
    ``saturable[<layer>]``. When the last module to run is one of them, :meth:`watch_last_squashed` sums the
    gradient its output gets under ``("rowsum", <layer>)`` (see :class:`_RowSums`): zero row sums mean the loss took
    its outputs for logits, as ``cross_entropy`` does, nothing left unexplained by a sigmoid of the loss's own, as
    ``binary_cross_entropy_with_logits`` does.

    Example::

        >>> batch = StatBatch()
        >>> batch.start()
        >>> recorder, relu = UnitRecorder(batch), nn.ReLU()
        >>> with HookHandles() as handles:
        ...     recorder.attach([("relu", relu)], handles)
        ...     _ = relu(torch.tensor([[-1.0, 1.0, 0.0], [-2.0, 2.0, 2.0]]))
        >>> batch.fetch().vectors[("units", "relu")], recorder.samples, recorder.per_unit
        ([0.0, 5.0, 4.0], {('units', 'relu'): 2}, {('units', 'relu')})
    """

    def __init__(self, batch: StatBatch, fired: set[str] | None = None) -> None:
        self.batch = batch
        self.fired = set() if fired is None else fired
        self.keys = OutputKeys("units")
        self.samples: dict[tuple[str, str], int] = {}
        self.per_unit: set[tuple[str, str]] = set()
        """The keys whose vector has one sum per unit (the others' is one sum for the whole output)."""
        self.order: dict[str, None] = {}
        self.calls = 0
        self.last_call: dict[str, int] = {}
        """Per module of :attr:`order`, the index of its latest call among this step's calls of hooked modules (a
        module that runs twice, as each torchvision ResNet block runs its one ReLU, runs last after the layers
        between)."""
        self.output_width = 0
        """The size of the last dimension of the latest output (the model's last layer's: a classifier's classes)."""
        self.with_grad: set[str] = set()
        """The modules of :attr:`order` that ran with gradients enabled (not under ``torch.no_grad()``)."""
        self.widths: dict[tuple[str, str], int] = {}
        """The unit count of each per-unit key since :meth:`start`."""
        self.saturable: dict[str, int] = {}
        self.last_squashed: tuple[str, torch.Tensor, int] | None = None
        """The latest sigmoid, tanh, softmax or (but for :attr:`last_clamped`) ReLU output that requires a gradient:
        its layer, the tensor and the dimension of its rows."""
        self.last_clamped: tuple[str, torch.Tensor] | None = None
        """The latest ReLU output that requires a gradient and has as many values as the batch's targets (see
        :attr:`target_numel`): its layer and the tensor."""
        self.target_numel: int | None = None
        """The number of values of the batch's last floating-point tensor of several (regression targets)."""
        self.prepend = False
        """Hook before the modules' other forward hooks (see :attr:`ActivationRecorder.prepend`)."""
        self.batch_tensors: dict[int, str] = {}
        """The batch's tensors to follow this step, by data pointer: their paths."""
        self.batch_sizes: dict[int, str] = {}
        """The batch's tensors to follow but the last (the targets, which no layer takes), by number of values: a copy
        made of one (``x / 255``, a noised ``x``) has as many."""
        self.takers: dict[str, str] = {}
        """Per batch tensor (path), the first module that took it (or a view of it) as an input; the
        :func:`~lightning_hooks.stats.state.input_sums` of what it took go under ``("taken", <path>)``."""
        self.entry: str | None = None
        """While batch tensors are followed, the first module to take any floating-point tensor; the
        :func:`~lightning_hooks.stats.state.input_sums` of what it took go under ``("entry", <module>)``."""
        self.sums: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
        """This step's :meth:`input_sums` by tensor id: the tensor, its version when they were taken, and the sums."""
        self.made: dict[Any, tuple[str, int, bool, int]] = {}
        """This step's module outputs by their autograd node: the module, its unit count, whether its own units
        are counted (a module without weights), and the dimension holding the units."""
        self.activations = True
        """Count the units of modules with weights after their functional activations (see :attr:`activated`)."""
        self.carried: dict[str, tuple[str, int, str]] = {}
        """Per dropout or pooling module that took a module's output with weights through functional operations
        (``self.dropout(F.relu(self.linear1(x)))``, as ``nn.TransformerEncoderLayer`` does): that module, its unit
        count and the operations. Its dead units are that module's, dead after its activation."""
        self.sources: dict[str, set[str | None]] = {}
        """Per module without weights whose units are counted, the modules with weights whose outputs it took as they
        came (``None``: anything else, such as a sum). One that took several (torchvision's ResNet block runs its one
        ReLU after ``bn1`` and after the sum) pools different units under its key: :meth:`add_shared` adds the sums of
        squares of each call's units under ``("after", <that module>)``, their units after it (see :attr:`after`)."""
        self.after: dict[str, str] = {}
        """Per module with weights under an ``("after", <module>)`` key, the module without weights that took its
        output."""
        self.per_source: dict[tuple[str, str], list[torch.Tensor]] = {}
        """This step's unit sums of squares of each call of a module without weights, by the module and its source."""
        self.activated: dict[str, str] = {}
        """Per module with weights whose output reached a linear or convolution layer through functional operations
        only (``F.relu``): those operations, nearest the module first. The sums of squares of the units that layer
        took go under ``("fed", <module>)``: they are the module's units after its activation."""

    def __getstate__(self) -> dict[str, Any]:
        # a step's autograd nodes and tensors
        return {**self.__dict__, "made": {}, "last_squashed": None, "last_clamped": None, "sums": {}, "per_source": {}}

    def start(self) -> None:
        self.samples, self.order, self.widths, self.saturable, self.with_grad = {}, {}, {}, {}, set()
        self.calls, self.last_call, self.output_width = 0, {}, 0
        self.last_squashed = self.last_clamped = None
        self.batch_tensors, self.batch_sizes, self.takers, self.entry, self.sums = {}, {}, {}, None, {}
        self.made, self.activated, self.carried, self.sources, self.after = {}, {}, {}, {}, {}
        self.per_source = {}

    def input_sums(self, t: torch.Tensor) -> torch.Tensor:
        """:func:`~lightning_hooks.stats.state.input_sums` of ``t``, taken once while it stays the same object at the
        same version (the batch tensor that the first layer takes as it is)."""
        found = self.sums.get(id(t))
        if found is None or found[0]() is not t or found[1] != t._version:
            found = self.sums[id(t)] = (weakref.ref(t), t._version, input_sums(t))
        return found[2]

    def watch_last_squashed(self) -> None:
        """Before backward: if the last module to run was a sigmoid, tanh, softmax or ReLU, sum the gradient its output
        gets (only the model's output layer is judged by it, so an attention's softmax is left alone); but a ReLU's
        whose output has as many values as the targets, sum the gradient that pushes its zeros down (see
        :class:`_Clamped`)."""
        found, self.last_squashed = self.last_squashed, None
        clamped, self.last_clamped = self.last_clamped, None
        last = next(reversed(self.order)) if self.order else None
        if found is not None and last == found[0]:
            found[1].register_hook(_RowSums(self.batch, found[0], found[1].detach(), found[2]))
        if clamped is not None and last == clamped[0]:
            clamped[1].register_hook(_Clamped(self.batch, clamped[0], clamped[1].detach()))

    def add_shared(self) -> None:
        """At the step's end, the units of each module with weights whose output a module without weights took, that
        module having taken other outputs too (see :attr:`sources`), under ``("after", <module with weights>)``."""
        for (name, source), sums in self.per_source.items():
            if len(self.sources.get(name, ())) > 1:
                self.after[source] = name
                for per_unit in sums:
                    self.batch.add_vector(("after", source), per_unit)
        self.per_source = {}

    def attach(self, modules: Sequence[tuple[str, nn.Module]], handles: HookHandles) -> None:
        hooks = []
        for name, module in modules:
            units = next(module.parameters(recurse=False), None) is None
            hooks.append((module, _UnitHook(self, name, channels_first(module), units)))
        handles.add_forward_hooks(hooks, prepend=self.prepend)


_WIDENED = (torch.float16, torch.bfloat16)
"""Squared in float32: a half value above 256 squares to Inf, one below about 2e-4 to zero."""


class _UnitHook:
    def __init__(self, recorder: UnitRecorder, name: str, channels_first: bool, units: bool) -> None:
        self.recorder, self.name, self.channels_first, self.units = recorder, name, channels_first, units

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if graph_task_id() != -1:  # activation checkpointing re-running forward (an eager hook: see in_backward)
            return
        recorder = self.recorder
        recorder.fired.add(self.name)
        if not recorder.batch.open:
            return
        recorder.order[self.name] = None
        recorder.calls += 1
        recorder.last_call[self.name] = recorder.calls
        recorder.output_width = output.shape[-1] if isinstance(output, torch.Tensor) and output.dim() else 0
        if torch.is_grad_enabled():
            recorder.with_grad.add(self.name)
        if recorder.batch_tensors:
            _follow_batch(recorder, self.name, args)
        if isinstance(module, _SATURABLE) and isinstance(output, torch.Tensor):
            _squashed(recorder, self.name, module, output)
        elif isinstance(module, _CLAMPING) and isinstance(output, torch.Tensor) and output.requires_grad:
            if output.numel() == recorder.target_numel:  # autograd keeps a ReLU's output for backward anyway
                recorder.last_clamped = (self.name, output)
            elif output.dim() >= 2 and output.shape[unit_dim(output)] > 1 and not is_sharded(output):
                recorder.last_squashed = (self.name, output, unit_dim(output))  # logits through a ReLU?
        if (
            recorder.activations
            and not self.units
            and isinstance(module, _UNIT_INPUTS)
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            _activated(recorder, module, args[0])
        if recorder.activations and self.units and isinstance(module, _CARRIERS) and args:
            made = _made_by(recorder, args[0]) if isinstance(args[0], torch.Tensor) else None
            if made is not None and not made[2]:
                recorder.carried[self.name] = (made[0], made[1], made[3])
        source = None  # the module with weights whose output this one took as it came
        axis = None  # where an elementwise module keeps that module's units (a channels-last GELU after a linear)
        if recorder.activations and self.units and args and isinstance(args[0], torch.Tensor):
            source = _source(recorder, args[0], output)
            recorder.sources.setdefault(self.name, set()).add(source[0] if source is not None else None)
            if source is not None and isinstance(output, torch.Tensor) and output.shape == args[0].shape:
                axis = source[2]
        if (
            recorder.activations
            and isinstance(output, torch.Tensor)
            and output.grad_fn is not None
            and output.dim() >= 2
        ):
            made_axis = _unit_axis(module, output) if axis is None else axis
            recorder.made[output.grad_fn] = (self.name, output.shape[made_axis], self.units, made_axis)
        for path, tensor in named_tensors(output):
            if not tensor.is_floating_point():
                continue
            x = counted_part(tensor.detach(), copies_off_mesh=False)  # a DTensor's own part (tensor parallelism)
            key = recorder.keys.key(self.name, path)
            if self.units and x.dim() >= 2:
                squares = _squares(x)
                dim = axis if axis is not None and not path else unit_dim(x, self.channels_first)
                if recorder.widths.setdefault(key, x.shape[dim]) != x.shape[dim]:
                    key = recorder.keys.eager(self.name, f"{path}[{x.shape[dim]}]")
                    recorder.widths[key] = x.shape[dim]
                per_unit = _per_unit(squares, dim)
                recorder.batch.add_vector(key, per_unit)
                recorder.per_unit.add(key)
                recorder.samples[key] = recorder.samples.get(key, 0) + x.numel() // max(x.shape[dim], 1)
                if source is not None and not path and source[1] == x.shape[dim]:
                    recorder.per_source.setdefault((self.name, source[0]), []).append(per_unit)
            else:
                recorder.batch.add_vector(key, _sum_of_squares(x))
                recorder.samples[key] = recorder.samples.get(key, 0) + x.numel()


def _follow_batch(recorder: UnitRecorder, name: str, args: tuple[Any, ...]) -> None:
    """Note the module as the taker of the batch tensors among its inputs (by data pointer: a view starts where the
    tensor does, a slice of its first columns too; else by size: a copy made of it, such as ``x / 255`` or a noised
    ``x``, has as many values) and as the entry if it is the first to take a floating-point tensor, with the sums of
    what it took: a model that slices its batch or scales it itself takes other values than the batch holds."""
    for arg in args:
        if not isinstance(arg, torch.Tensor) or arg.layout != torch.strided or not arg.is_floating_point():
            continue  # a sparse tensor has no one address; integers are indices
        path = recorder.batch_tensors.get(arg.data_ptr())
        if path is None or path in recorder.takers:
            path = recorder.batch_sizes.get(arg.numel())
        if path is not None and path not in recorder.takers:
            recorder.takers[path] = name
            recorder.batch.add_vector(("taken", path), recorder.input_sums(counted_part(arg, copies_off_mesh=False)))
        if recorder.entry is None and arg.numel():
            recorder.entry = name
            recorder.batch.add_vector(("entry", name), recorder.input_sums(counted_part(arg, copies_off_mesh=False)))
    if recorder.entry is not None and recorder.takers.keys() >= set(recorder.batch_tensors.values()):
        recorder.batch_tensors = {}  # every batch tensor has its taker: nothing left to follow in this micro-batch


_CARRIERS = (
    nn.modules.dropout._DropoutNd,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
)
"""Modules that pass units on as they came (a unit dead before them stays dead)."""
_UNIT_INPUTS = (nn.Linear, nn.modules.conv._ConvNd)
"""The layers whose input units are read as the units of the module that made them (each a column of weights)."""
FUNCTIONAL_DEPTH = 4
"""How many autograd nodes back from a layer's input :func:`_activated` looks for the module that made it."""


def _unit_axis(module: nn.Module, t: torch.Tensor) -> int:
    """The dimension of a module's input or output that holds its units: a linear layer's last, else
    :func:`unit_dim`'s."""
    return t.dim() - 1 if isinstance(module, nn.Linear) else unit_dim(t, channels_first(module))


def _made_by(recorder: UnitRecorder, x: torch.Tensor) -> tuple[str, int, bool, str] | None:
    """The module of this step that made ``x`` by functional operations only (``F.relu(self.fc1(h))``): its name,
    unit count, whether its own units are counted, and the operations, nearest it first. ``None`` for a batch
    tensor (no autograd node), a module's output as it came, or one made further back."""
    if not x.is_floating_point() or x.dim() < 2 or x.grad_fn is None or x.grad_fn in recorder.made:
        return None
    frontier, ops = [x.grad_fn], [x.grad_fn.name()]
    for _ in range(FUNCTIONAL_DEPTH):
        parents = [p for node in frontier for p, _ in node.next_functions if p is not None][:8]
        maker = next((recorder.made[p] for p in parents if p in recorder.made), None)
        if maker is not None:
            return *maker[:3], ", ".join(re.sub(r"Backward\d*$", "", op).lower() for op in reversed(ops))
        frontier = parents
        ops += [p.name() for p in parents[:1]]
    return None


def _source(recorder: UnitRecorder, x: torch.Tensor, output: Any) -> tuple[str, int, int] | None:
    """The module with weights whose output ``x`` is, as it came, its unit count and the dimension holding them:
    ``x``'s autograd node, or the one before it where ``x`` is the module's ``output`` too (``nn.ReLU(inplace=True)``
    wrote over it)."""
    node = x.grad_fn
    if node is not None and x is output:
        node = node.next_functions[0][0] if node.next_functions else None
    made = recorder.made.get(node) if node is not None else None
    return (made[0], made[1], made[3]) if made is not None and not made[2] else None


def _activated(recorder: UnitRecorder, module: nn.Module, x: torch.Tensor) -> None:
    """When ``x``, a linear or convolution layer's input, was made from a module with weights by functional
    operations only (no module between them to count its units), sum the squares of its units under
    ``("fed", <that module>)``: a unit zero for every sample is that module's unit, dead after its activation. After
    ``torch.tanh`` or ``torch.sigmoid`` alone, count its saturated values too, under ``("sat", <that module>)``."""
    made = _made_by(recorder, x)
    dim = _unit_axis(module, x)
    if made is None or made[2] or x.shape[dim] != made[1]:  # a module without weights counts its own units
        return
    name, width, _, ops = made
    x = counted_part(x.detach(), copies_off_mesh=False)
    key = ("fed", name)
    recorder.batch.add_vector(key, _per_unit(_squares(x), dim))
    recorder.samples[key] = recorder.samples.get(key, 0) + x.numel() // max(width, 1)
    recorder.activated.setdefault(name, ops)
    if ops in ("tanh", "sigmoid"):  # saturated as an nn.Tanh's or nn.Sigmoid's outputs are
        _add_saturated(recorder, name, _bound_gap(x, ops == "tanh"), x.numel())


_SATURABLE = (nn.Sigmoid, nn.Tanh, nn.Softmax)
_CLAMPING = (nn.ReLU, nn.ReLU6)
"""Modules whose outputs stop at zero: after a model's output layer, no prediction can be negative."""


def _squashed(recorder: UnitRecorder, name: str, module: nn.Module, output: torch.Tensor) -> None:
    """Count a sigmoid, tanh or softmax output's saturated values (not over one unit: a softmax of one is always 1)
    and keep it as the latest one that requires a gradient."""
    y = output.detach()
    dim = (module.dim if module.dim is not None else -1) if isinstance(module, nn.Softmax) else -1
    if output.requires_grad and not is_sharded(output):
        recorder.last_squashed = (name, output, dim)  # autograd keeps all three's outputs for backward anyway
    if y.shape[-1:] == (1,):
        return
    if isinstance(module, nn.Softmax):
        gap, n = 1 - y.amax(dim), y.numel() // max(y.shape[dim], 1)  # rows whose largest value is almost 1
    else:
        gap, n = _bound_gap(y, isinstance(module, nn.Tanh)), y.numel()
    _add_saturated(recorder, name, gap, n)


def _bound_gap(y: torch.Tensor, tanh: bool) -> torch.Tensor:
    """How far each of a tanh's (or else a sigmoid's) outputs is from its nearer bound."""
    return 1 - y.abs() if tanh else 0.5 - (y - 0.5).abs()


def _add_saturated(recorder: UnitRecorder, name: str, gap: torch.Tensor, n: int) -> None:
    """Count the values within 0.1 % of their bounds under ``("sat", name)``, out of ``n`` more saturable ones."""
    recorder.batch.add_vector(("sat", name), (gap < 1e-3).sum().reshape(1))
    recorder.saturable[name] = recorder.saturable.get(name, 0) + n


def _widened(x: torch.Tensor) -> torch.Tensor:
    """``x``, in float32 if it is half precision (see :data:`_WIDENED`)."""
    return x.float() if x.dtype in _WIDENED else x


def _squares(x: torch.Tensor) -> torch.Tensor:
    """``x`` squared, in float32 for a half-precision ``x``."""
    return _widened(x).square()


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """``Σ x²`` as one dot product of ``x`` with itself (no squared copy of it), in float32 for a half-precision
    ``x``."""
    flat = _widened(x).reshape(-1)
    return torch.dot(flat, flat)


def _per_unit(squares: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of ``squares`` over every dimension but the units' ``dim``."""
    return squares.sum([d for d in range(squares.dim()) if d != dim])


class _RowSums:
    """A squashed output's gradient hook: adds ``[Σ_rows |Σ_row g|, Σ |g|, Σ |g - c (σ(y) - t)|]`` to the batch, the
    gradient unchanged. The last is what ``binary_cross_entropy_with_logits`` of the output ``y`` leaves unexplained,
    beyond the rounding of the gradient's dtype: its gradient is ``c (σ(y) - t)``, with the target ``t`` 0 where the
    gradient is positive and 1 where it is negative, and ``c`` (the loss's scale: ``1 / N`` for a mean,
    ``pos_weight / N`` for the positives) fitted to each sign; all of it for fewer than 8 values, which any scale
    fits (one bag a step of multiple-instance learning under ``binary_cross_entropy``)."""

    def __init__(self, batch: StatBatch, name: str, output: torch.Tensor, dim: int) -> None:
        self.batch, self.name, self.output, self.dim = batch, name, output, dim

    def __call__(self, grad: torch.Tensor) -> None:
        g = grad.detach().float()
        p = torch.sigmoid(self.output.float())
        negative, positive = g < 0, g > 0
        own = torch.where(negative, p - 1, p)  # σ(y) - t
        scales = [(g * side).sum() / (own * side).sum() for side in (positive, negative)]
        miss = (g - torch.where(negative, scales[1], scales[0]) * own).abs() - torch.finfo(grad.dtype).eps * g.abs()
        unexplained = torch.where(g != 0, miss.clamp(min=0), 0.0).sum()  # beyond the gradient's own rounding
        unexplained = unexplained if g.numel() >= 8 else g.abs().sum()  # a scale fitted to a value or two fits it
        rows = g.sum(self.dim).abs().sum()
        self.batch.add_vector(("rowsum", self.name), torch.stack([rows, g.abs().sum(), unexplained]))


class _Clamped:
    """A ReLU output's gradient hook: adds ``[Σ g where the output is 0 and g > 0, Σ |g|]`` to the batch, the gradient
    unchanged. A positive gradient asks for a lower output: at an output held at 0, one the ReLU cannot give (a
    target below zero, for a squared error)."""

    def __init__(self, batch: StatBatch, name: str, output: torch.Tensor) -> None:
        self.batch, self.name, self.output = batch, name, output

    def __call__(self, grad: torch.Tensor) -> None:
        g = grad.detach().float()
        pushed = torch.where((self.output == 0) & (g > 0), g, 0.0).sum()
        self.batch.add_vector(("clamped", self.name), torch.stack([pushed, g.abs().sum()]))


_CHANNELS_FIRST = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def channels_first(module: nn.Module) -> bool:
    """Whether the module's 3-d outputs are ``(batch, channels, length)`` (1-d convolutions, their norms and
    poolings) rather than ``(batch, sequence, features)``."""
    return isinstance(module, _CHANNELS_FIRST) or type(module).__name__.endswith(("Pool1d", "Pool2d", "Pool3d"))


def unit_dim(t: torch.Tensor, channels_first: bool = False) -> int:
    """The dimension of ``t`` that holds a layer's units (see :class:`UnitRecorder`)."""
    return 1 if t.dim() in (4, 5) or (t.dim() == 3 and channels_first) else t.dim() - 1

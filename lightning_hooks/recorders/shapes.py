"""Recording per-call input and output shapes with forward hooks (pure torch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from lightning_hooks.core.autograd import in_backward
from lightning_hooks.core.compiled import Region, Switched
from lightning_hooks.core.handles import HookHandles, made_once
from lightning_hooks.core.nested import (
    Leaf,
    Signature,
    call_inputs,
    describe,
    format_signature,
    named_tensors,
    signature,
)
from lightning_hooks.core.select import ModuleSelector, label, type_label
from lightning_hooks.core.shards import is_sharded, local
from lightning_hooks.core.tables import markdown_table

__all__ = ["ShapeRecorder", "ShapeRow", "format_table", "parameter_count", "shape_table", "trace_shapes"]


@dataclass
class ShapeRow:
    """One call of one module."""

    name: str
    type: str
    params: int
    inputs: Signature
    outputs: Signature = ()

    def key(self) -> tuple[str, Signature, Signature]:
        return (self.name, self.inputs, self.outputs)


@dataclass
class ShapeRecorder:
    """Collects a :class:`ShapeRow` per module call while ``active``, in the order calls start; holds no tensor."""

    active: bool = False
    rows: list[ShapeRow] = field(default_factory=list)
    tensor_parallel: bool = False
    """Show a plain tensor that is the local part of a ``DTensor`` met in the same step (the activation between a
    column- and a row-wise layer) as that ``DTensor`` is shown: its whole shape, and the local one."""
    _open: dict[str, list[ShapeRow]] = field(default_factory=dict)
    _hooks: dict[str, tuple[_ShapePreHook, _ShapeHook]] = field(default_factory=dict)
    _parts: _LocalParts | None = None
    _traced: dict[int, _TracedCalls] = field(default_factory=dict)
    """Per compiled region (by id), what its hooks noted in the call running now."""

    def clear(self) -> None:
        self.rows, self._open = [], {}
        self._parts = _LocalParts() if self.tensor_parallel else None

    def _begin(self, hook: _ShapePreHook, inputs: Signature, value: Any = None) -> None:
        """A call of ``hook``'s module starts: a row, in the order calls start; ``value`` (what the inputs are) lets
        a local part be matched to its ``DTensor``."""
        row = ShapeRow(hook.name, hook.type_name, hook.params, inputs)
        if self._parts is not None and value is not None:
            self._parts.note(row, False, value)
        self.rows.append(row)
        self._open.setdefault(hook.name, []).append(row)

    def _end(self, name: str, outputs: Signature, value: Any = None) -> None:
        """The last call of ``name`` still open returned."""
        if pending := self._open.get(name):
            row = pending.pop()
            row.outputs = outputs
            if self._parts is not None and value is not None:
                self._parts.note(row, True, value)

    def attach(
        self,
        modules: list[tuple[str, nn.Module]],
        handles: HookHandles,
        params: dict[str, int] | None = None,
        prepend: bool = False,
    ) -> None:
        """Hook ``modules`` into ``handles``; ``params`` (qualified name to parameter count) saves recounting them.
        With ``prepend`` the output hooks go before the modules' own (under tensor parallelism: a parallelised
        module's output is seen as the ``DTensor`` it made, before its style turns it into a local tensor)."""

        self.tensor_parallel = prepend
        self._parts = _LocalParts() if prepend else None

        hooks = self._made(modules, params)
        handles.add_forward_pre_hooks([(module, pre) for module, (pre, _) in hooks], with_kwargs=True)
        handles.add_forward_hooks([(module, post) for module, (_, post) in hooks], always_call=True, prepend=prepend)

    def attach_switched(
        self, modules: Sequence[tuple[str, nn.Module, Region]], handles: HookHandles, params: dict[str, int]
    ) -> None:
        """Hook modules inside compiled regions for a whole fit: the hooks run while their region's switch is on,
        inlined by dynamo into that graph, so that a recorded step runs compiled. Traced code only notes each call's
        signature; the rows are made as the region returns (taken while ``active``), in the order of the calls. A
        tensor-parallel local part met there is shown by its own shape."""
        made = self._made([(name, module) for name, module, _ in modules], params)
        for (module, (pre, post)), (_, _, region) in zip(made, modules, strict=True):
            calls = self._traced.setdefault(id(region), _TracedCalls(self))
            region.settles(calls)
            starts, ends = Switched(region.switch, _Traced(pre, calls)), Switched(region.switch, _Traced(post, calls))
            handles.add(module.register_forward_pre_hook(starts, with_kwargs=True))
            handles.add(module.register_forward_hook(ends, always_call=True))

    def _made(
        self, modules: Sequence[tuple[str, nn.Module]], params: dict[str, int] | None
    ) -> list[tuple[nn.Module, tuple[_ShapePreHook, _ShapeHook]]]:
        def make(name: str, module: nn.Module) -> tuple[_ShapePreHook, _ShapeHook]:
            count = params[name] if params is not None else parameter_count(module)
            return _ShapePreHook(self, name, type_label(module), count), _ShapeHook(self, name)

        return made_once(self._hooks, modules, make)

    def table(self) -> tuple[tuple[str, Signature, Signature], ...]:
        """What the recorded rows say, comparable between steps."""
        return tuple(row.key() for row in self.rows)


def parameter_count(module: nn.Module) -> int:
    """Parameters of the module and its children, each shared parameter counted once."""
    return sum(p.numel() for p in module.parameters())


class _ShapePreHook:
    def __init__(self, recorder: ShapeRecorder, name: str, type_name: str, params: int) -> None:
        self.recorder, self.name, self.type_name, self.params = recorder, name, type_name, params

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        recorder = self.recorder
        if recorder.active and not in_backward():  # not activation checkpointing re-running forward
            inputs = call_inputs(args, kwargs)
            recorder._begin(self, signature(inputs), inputs)

    def take(self, inputs: Signature) -> None:
        self.recorder._begin(self, inputs)


class _ShapeHook:
    def __init__(self, recorder: ShapeRecorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        recorder = self.recorder
        if recorder.active and not in_backward():
            recorder._end(self.name, signature(output), output)

    def take(self, outputs: Signature) -> None:
        self.recorder._end(self.name, outputs)


class _TracedCalls:
    """The signatures the hooks of one compiled region noted in a call of it. Empty whenever the region is entered
    (dynamo guards on the list's length: a list that kept rows between calls would recompile the graph), and made
    into rows by :meth:`settle` as it returns."""

    def __init__(self, recorder: ShapeRecorder) -> None:
        self.recorder = recorder
        self.calls: list[tuple[_ShapePreHook | _ShapeHook, Signature]] = []

    def settle(self) -> None:
        calls = list(self.calls)
        self.calls.clear()
        if self.recorder.active:
            for hook, seen in calls:
                hook.take(seen)


class _Traced:
    """A shape hook as it runs inside a compiled region: it notes the call's signature in ``into``."""

    def __init__(self, hook: _ShapePreHook | _ShapeHook, into: _TracedCalls) -> None:
        self.hook, self.into = hook, into

    def __call__(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        if in_backward():  # the region run eagerly (a forced eager stance), its checkpointed forward run again
            return
        seen = rest[-1] if isinstance(self.hook, _ShapeHook) else call_inputs(args, rest[0])
        self.into.calls.append((self.hook, signature(seen)))


class _LocalParts:
    """Plain tensors of a step that are the local part of a ``DTensor`` met in the same step, before or after
    them: matched by where their values start and their shape, and shown as the ``DTensor`` is. Holds no tensor."""

    def __init__(self) -> None:
        self.shown: dict[tuple[int, tuple[int, ...]], Leaf] = {}
        self.waiting: dict[tuple[int, tuple[int, ...]], list[tuple[ShapeRow, bool, str]]] = {}

    def note(self, row: ShapeRow, outputs: bool, value: Any) -> None:
        for path, t in named_tensors(value):
            sharded = is_sharded(t)
            if (key := _place(local(t) if sharded else t)) is None:
                continue
            if sharded:
                self.shown[key] = describe(t)
                for waiting in self.waiting.pop(key, ()):
                    _replace_leaf(*waiting, self.shown[key])
            elif key in self.shown:
                _replace_leaf(row, outputs, path, self.shown[key])
            else:
                self.waiting.setdefault(key, []).append((row, outputs, path))


def _place(t: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """Where a tensor's values start, and its shape; ``None`` for one without values in memory (empty, fake)."""
    try:
        return (t.data_ptr(), tuple(t.shape)) if t.numel() else None
    except RuntimeError:
        return None


def _replace_leaf(row: ShapeRow, outputs: bool, path: str, leaf: Leaf) -> None:
    old = row.outputs if outputs else row.inputs
    new = tuple((p, leaf if p == path else v) for p, v in old)
    if outputs:
        row.outputs = new
    else:
        row.inputs = new


def trace_shapes(model: nn.Module, *args: Any, selector: ModuleSelector | None = None, **kwargs: Any) -> list[ShapeRow]:
    """Run ``model(*args, **kwargs)`` once and return a row per module call; no hook outlives the call.

    Example::

        >>> import torch
        >>> model = nn.Sequential(nn.Linear(5, 3), nn.ReLU())
        >>> print(format_table(trace_shapes(model, torch.zeros(2, 5))))
        Layer  Type        Input   Output  Params
        -----  ----------  ------  ------  ------
        root   Sequential  [2, 5]  [2, 3]  18
        0      Linear      [2, 5]  [2, 3]  18
        1      ReLU        [2, 3]  [2, 3]  0
    """
    recorder = ShapeRecorder(active=True)
    with HookHandles() as handles:
        recorder.attach((selector or ModuleSelector()).select(model), handles)
        model(*args, **kwargs)
    return recorder.rows


_HEADER = ("Layer", "Type", "Input", "Output", "Params")

MIN_REPEATS = 3
"""The shortest run of identical sibling blocks that a table collapses (a pair is shown in full)."""


class _Named(Protocol):
    @property
    def name(self) -> str: ...


Row = TypeVar("Row", bound=_Named)


def _shape_key(row: ShapeRow) -> tuple[object, ...]:
    return (row.type, row.params, row.inputs, row.outputs)


def _segment(rows: Sequence[_Named], start: int, prefix: str) -> int:
    """The end of the calls from ``start`` on that belong to the module named ``prefix`` or below it."""
    end = start
    while end < len(rows) and (rows[end].name == prefix or rows[end].name.startswith(prefix + ".")):
        end += 1
    return end


def _shape_of(rows: Sequence[Row], prefix: str, key: Callable[[Row], tuple[object, ...]]) -> tuple[object, ...]:
    """What a block's calls say (``key``) with its own name taken off: equal for blocks that only differ in index."""
    return tuple((r.name[len(prefix) :], *key(r)) for r in rows)


@dataclass(frozen=True)
class _Run:
    """``count`` consecutive identical sibling blocks, from the one named ``first`` to the one numbered ``last``."""

    first: str
    last: int
    count: int
    block_end: int  # where the first block's calls end
    end: int  # where the last block's calls end


def _run(rows: Sequence[Row], start: int, key: Callable[[Row], tuple[object, ...]]) -> _Run | None:
    """The run of at least :data:`MIN_REPEATS` identical sibling blocks (``layer.0``, ``layer.1``, …) whose
    first call is ``rows[start]``, tried from the outermost numbered component of its name inwards."""
    parts = rows[start].name.split(".")
    for depth, part in enumerate(parts):
        if not part.isdigit():
            continue
        parent, first, prefix = ".".join(parts[:depth]), int(part), ".".join(parts[: depth + 1])
        block_end = _segment(rows, start, prefix)
        shape, count, end = _shape_of(rows[start:block_end], prefix, key), 1, block_end
        while True:
            sibling = f"{parent}.{first + count}" if parent else str(first + count)
            next_end = _segment(rows, end, sibling)
            if next_end == end or _shape_of(rows[end:next_end], sibling, key) != shape:
                break
            count, end = count + 1, next_end
        if count >= MIN_REPEATS:
            return _Run(prefix, first + count - 1, count, block_end, end)
    return None


def collapse_repeats(
    rows: Sequence[Row],
    key: Callable[[Row], tuple[object, ...]] = _shape_key,  # type: ignore[assignment]
) -> list[tuple[str, Row, int]]:
    """``(shown name, row, repeats)`` per line of a table: runs of identical sibling blocks once, identical in what
    ``key`` says of each row (a shape row's class, parameters and shapes).

    A run of at least :data:`MIN_REPEATS` sibling blocks with the same calls below them is shown as
    its first block, named with the range of indices (``encoder.layer.0–23``) and counted on its first line.

    Example::

        >>> import torch
        >>> model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(5)), nn.ReLU())
        >>> print(format_table(trace_shapes(model, torch.zeros(2, 4))))
        Layer    Type        Input   Output  Params
        -------  ----------  ------  ------  ------
        root     Sequential  [2, 4]  [2, 4]  100
        0–4  ×5  Linear      [2, 4]  [2, 4]  20
        5        ReLU        [2, 4]  [2, 4]  0
    """
    shown: list[tuple[str, Row, int]] = []
    i = 0
    while i < len(rows):
        run = _run(rows, i, key)
        if run is None:
            shown.append((label(rows[i].name), rows[i], 1))
            i += 1
            continue
        head = f"{run.first}\u2013{run.last}"
        block = enumerate(collapse_repeats(rows[i : run.block_end], key))
        shown += [(head + name[len(run.first) :], row, run.count if j == 0 else n) for j, (name, row, n) in block]
        i = run.end
    return shown


def _cells(rows: list[ShapeRow], collapse: bool) -> list[tuple[str, ...]]:
    shown = collapse_repeats(rows) if collapse else [(label(r.name), r, 1) for r in rows]
    named = [(f"{name}  \u00d7{n}" if n > 1 else name, r) for name, r, n in shown]
    return [
        (name, r.type, format_signature(r.inputs), format_signature(r.outputs), f"{r.params:,}") for name, r in named
    ]


CELL_MAX = 48
"""The widest cell of the printed table: a longer one (a call with many arguments) is cut short with "…"; the
markdown table that loggers get keeps it whole."""


def _short(cell: str) -> str:
    return cell if len(cell) <= CELL_MAX else cell[: CELL_MAX - 1] + "…"


def format_table(rows: list[ShapeRow], collapse: bool = True) -> str:
    """A plain-text table with aligned columns, for the terminal, each cell at most :data:`CELL_MAX` characters;
    ``collapse`` as in :func:`collapse_repeats`."""
    cells = [_HEADER, *(tuple(_short(c) for c in row) for row in _cells(rows, collapse))]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def shape_table(rows: list[ShapeRow], collapse: bool = True) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``(columns, cells)``: the table as data, one row per module call, for a logger's own table form."""
    return _HEADER, _cells(rows, collapse)


def format_markdown(rows: list[ShapeRow], collapse: bool = True) -> str:
    """The same table in markdown, which TensorBoard's text dashboard renders as a table."""
    return markdown_table(*shape_table(rows, collapse))

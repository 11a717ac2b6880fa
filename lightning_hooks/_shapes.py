"""Recording per-call input and output shapes with forward hooks (pure torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_hooks._autograd import in_backward
from lightning_hooks._handles import HookHandles
from lightning_hooks._nested import Signature, call_inputs, format_signature, signature
from lightning_hooks._select import ModuleSelector, label, type_label
from lightning_hooks._tables import markdown_table


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
    """Collects a :class:`ShapeRow` per module call while ``active``; holds no tensor.

    Rows are in the order calls start, so a container comes before its children and a module
    called twice gets two rows.
    """

    active: bool = False
    rows: list[ShapeRow] = field(default_factory=list)
    _open: dict[str, list[ShapeRow]] = field(default_factory=dict)

    def clear(self) -> None:
        self.rows = []
        self._open = {}

    def attach(
        self, modules: list[tuple[str, nn.Module]], handles: HookHandles, params: dict[str, int] | None = None
    ) -> None:
        """Hook ``modules``; ``params`` (qualified name to parameter count) saves recounting them."""
        for name, module in modules:
            count = params[name] if params is not None else parameter_count(module)
            handles.add(
                module.register_forward_pre_hook(_ShapePreHook(self, name, type_label(module), count), with_kwargs=True)
            )
            handles.add(module.register_forward_hook(_ShapeHook(self, name), always_call=True))

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
        if not recorder.active or in_backward():
            return
        row = ShapeRow(self.name, self.type_name, self.params, signature(call_inputs(args, kwargs)))
        recorder.rows.append(row)
        recorder._open.setdefault(self.name, []).append(row)


class _ShapeHook:
    def __init__(self, recorder: ShapeRecorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        recorder = self.recorder
        if not recorder.active or in_backward():
            return
        pending = recorder._open.get(self.name)
        if pending:
            pending.pop().outputs = signature(output)


def trace_shapes(model: nn.Module, *args: Any, selector: ModuleSelector | None = None, **kwargs: Any) -> list[ShapeRow]:
    """Run ``model(*args, **kwargs)`` once and return a row per module call.

    No hook outlives the call, whether it returns or raises.

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


def _cells(rows: list[ShapeRow]) -> list[tuple[str, ...]]:
    return [
        (label(r.name), r.type, format_signature(r.inputs), format_signature(r.outputs), f"{r.params:,}") for r in rows
    ]


def format_table(rows: list[ShapeRow]) -> str:
    """A plain-text table with aligned columns, for the terminal."""
    cells = [_HEADER, *_cells(rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def shape_table(rows: list[ShapeRow]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``(columns, cells)``: the table as data, one row per module call, for a logger's own table form."""
    return _HEADER, _cells(rows)


def format_markdown(rows: list[ShapeRow]) -> str:
    """The same table in markdown, which TensorBoard's text dashboard renders as a table."""
    return markdown_table(*shape_table(rows))

"""What a recorded step's memory says, in words and tables: the advice line and the table (pure Python)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from lightning_hooks.core.select import label
from lightning_hooks.core.tables import markdown_table
from lightning_hooks.recorders.memory import OPTIMIZER, MemoryRow, StepMemory
from lightning_hooks.recorders.shapes import collapse_repeats

__all__ = ["Blocks", "advice", "checkpoint_saving", "format_memory_table", "memory_table", "mib", "repeated_blocks"]

_HEADER = ("Layer", "Type", "Params", "Grads", "Optimizer", "Activations", "Temporaries", "Peak")


def mib(n: float) -> str:
    """Bytes in the unit that reads best: ``512 B``, ``3.0 KiB``, ``12.4 MiB``, ``1.50 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Blocks:
    """Sibling blocks of one type (``encoder.layer.0``, ``encoder.layer.1``, …) whose names differ in the index."""

    pattern: str
    rows: tuple[MemoryRow, ...]


def repeated_blocks(rows: list[MemoryRow]) -> list[Blocks]:
    """Groups of at least two sibling blocks named ``<parent>.<index>`` with the same type, largest activations
    first: what activation checkpointing wraps one by one."""
    groups: dict[tuple[str, str], list[MemoryRow]] = {}
    for row in rows:
        parent, _, index = row.name.rpartition(".")
        if index.isdigit():
            groups.setdefault((parent, row.type), []).append(row)
    found = [Blocks(f"{parent}.*" if parent else "*", tuple(g)) for (parent, _), g in groups.items() if len(g) > 1]
    return sorted(found, key=lambda b: -sum(r.activations for r in b.rows))


def checkpoint_saving(memory: StepMemory, blocks: Blocks) -> int:
    """Bytes that checkpointing every block of ``blocks`` would take off the peak: each block then keeps only its
    input for backward, and backward recomputes one block at a time (the largest comes back while it runs, wherever
    the peak was before)."""
    if memory.peak_at == OPTIMIZER:
        return 0  # the peak is in the optimizer's update, when no activation is left
    kept = sum(r.activations - min(memory.inputs.get(r.name, 0), r.activations) for r in blocks.rows)
    return max(0, kept - max(r.activations for r in blocks.rows))


def advice(memory: StepMemory, peaks: list[int]) -> str:
    """The summary line: the peak, where it happens, and what would lower it most (``peaks``: each rank's)."""
    peak = max(peaks) if peaks else memory.peak
    line = f"peak {mib(memory.peak)} at {memory.peak_at}"
    if len(peaks) > 1:
        line += f"; largest over {len(peaks)} ranks {mib(peak)} on rank {peaks.index(peak)}"
    if memory.peak <= 0:
        return line
    blocks = repeated_blocks(memory.rows)
    saving = checkpoint_saving(memory, blocks[0]) if blocks else 0
    if blocks and saving >= memory.optimizer_state:
        return (
            f"{line}; activation checkpointing of `{blocks[0].pattern}` ({len(blocks[0].rows)} blocks) would free "
            f"about {mib(saving)} of the {mib(memory.peak)} peak"
        )
    # Checkpointing would free less than the optimizer's state; with no blocks in the table, the larger of the two.
    if memory.optimizer_state and (blocks or memory.optimizer_state >= memory.activations):
        share = 100 * memory.optimizer_state / memory.peak
        return f"{line}; optimizer state is {share:.0f} % of the peak (a sharded or 8-bit optimizer would cut it)"
    return f"{line}; activations kept for backward are {100 * memory.activations / memory.peak:.0f} % of the peak"


def _key(row: MemoryRow) -> tuple[object, ...]:
    return (row.type, row.parameters, row.gradients, row.optimizer_state, row.activations)


def _members(shown: str) -> list[str]:
    """The names a collapsed line stands for: ``layers.0–2.mlp`` is ``layers.0.mlp``, ``layers.1.mlp``, …"""
    parts = re.split(r"(\d+)\u2013(\d+)", shown)
    choices = [
        [parts[i]] if i % 3 == 0 else [str(n) for n in range(int(parts[i]), int(parts[i + 1]) + 1)]
        for i in range(len(parts))
        if i % 3 != 2
    ]
    return ["".join(c) for c in itertools.product(*choices)]


def _cells(rows: list[MemoryRow], collapse: bool) -> list[tuple[str, ...]]:
    """A line per row, a run of sibling blocks equal in all but their peak and temporaries once (their largest)."""
    by_name = {label(r.name): r for r in rows}
    lines = collapse_repeats(rows, _key) if collapse else [(label(r.name), r, 1) for r in rows]
    cells = []
    for shown, row, n in lines:
        members = [by_name[m] for m in _members(shown) if m in by_name] or [row]
        peak, temps = max(m.peak for m in members), max(m.temporaries for m in members)
        name = f"{shown}  \u00d7{n}" if n > 1 else shown
        sizes = (row.parameters, row.gradients, row.optimizer_state, row.activations, temps, peak)
        cells.append((name, row.type, *(mib(s) for s in sizes)))
    return cells


def memory_table(rows: list[MemoryRow], collapse: bool = True) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``(columns, cells)``: the table as data, for a logger's own table form."""
    return _HEADER, _cells(rows, collapse)


def format_memory_table(rows: list[MemoryRow], collapse: bool = True) -> str:
    """A plain-text table with aligned columns, sizes right-aligned, for the terminal."""
    cells = [_HEADER, *_cells(rows, collapse)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADER))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    lines = [line(row).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_memory_markdown(rows: list[MemoryRow], collapse: bool = True) -> str:
    """The same table in markdown, which TensorBoard's text dashboard renders as a table."""
    return markdown_table(*memory_table(rows, collapse))

"""Lightning callbacks that show what happens inside a training run, built on PyTorch's hooks.

The callbacks load Lightning on first use: the pure-torch helpers work without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_hooks.diagnose.finding import Finding
from lightning_hooks.diagnose.health import HealthFinding
from lightning_hooks.recorders.finite import find_nonfinite
from lightning_hooks.recorders.shapes import ShapeRow, format_table, trace_shapes

if TYPE_CHECKING:
    from lightning_hooks.callbacks import (
        ActivationStats,
        GradClamp,
        GradStats,
        HealthMonitor,
        MemoryLogger,
        NonFiniteError,
        NonFiniteGuard,
        ShapeLogger,
    )
    from lightning_hooks.recorders.memory import MemoryRow

__version__ = "0.1.0"

__all__ = [
    "ActivationStats",
    "Finding",
    "GradClamp",
    "GradStats",
    "HealthFinding",
    "HealthMonitor",
    "MemoryLogger",
    "MemoryRow",
    "NonFiniteError",
    "NonFiniteGuard",
    "ShapeLogger",
    "ShapeRow",
    "__version__",
    "find_nonfinite",
    "format_table",
    "trace_shapes",
]


def __getattr__(name: str) -> Any:
    """Load the callbacks, and Lightning with them, on first use (the names of ``__all__`` not bound above)."""
    if name not in __all__:
        raise AttributeError(f"module 'lightning_hooks' has no attribute {name!r}")
    if name == "MemoryRow":  # pure torch, but its module imports torch's memory trackers: loaded on first use too
        from lightning_hooks.recorders.memory import MemoryRow

        globals()[name] = MemoryRow
        return MemoryRow
    try:
        callbacks = importlib.import_module("lightning_hooks.callbacks")
    except ImportError as error:
        if error.name is None or error.name.split(".")[0] not in ("lightning", "lightning_fabric"):
            raise
        raise ImportError(
            f"`lightning_hooks.{name}` is a Lightning callback and needs Lightning, which could not be imported "
            f"({error}); install it with `pip install lightning`. The pure-torch helpers (`trace_shapes`, "
            f"`format_table`, `find_nonfinite`) work without it."
        ) from error
    value = getattr(callbacks, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

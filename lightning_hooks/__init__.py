"""Lightning callbacks that show what happens inside a training run, built on PyTorch's hooks."""

from lightning_hooks._shapes import ShapeRow, format_table, trace_shapes
from lightning_hooks.callbacks import (
    ActivationStats,
    GradClamp,
    GradStats,
    NonFiniteError,
    NonFiniteGuard,
    ShapeLogger,
)

__version__ = "0.1.0"

__all__ = [
    "ActivationStats",
    "GradClamp",
    "GradStats",
    "NonFiniteError",
    "NonFiniteGuard",
    "ShapeLogger",
    "ShapeRow",
    "__version__",
    "format_table",
    "trace_shapes",
]

from lightning_hooks.callbacks.activation_stats import ActivationStats
from lightning_hooks.callbacks.grad_clamp import GradClamp
from lightning_hooks.callbacks.grad_stats import GradStats
from lightning_hooks.callbacks.health_monitor import HealthMonitor
from lightning_hooks.callbacks.memory_logger import MemoryLogger
from lightning_hooks.callbacks.nonfinite_guard import NonFiniteError, NonFiniteGuard
from lightning_hooks.callbacks.shape_logger import ShapeLogger

__all__ = [
    "ActivationStats",
    "GradClamp",
    "GradStats",
    "HealthMonitor",
    "MemoryLogger",
    "NonFiniteError",
    "NonFiniteGuard",
    "ShapeLogger",
]

from lightning_hooks.callbacks.grad_clamp import GradClamp
from lightning_hooks.callbacks.shape_logger import ShapeLogger

__all__ = ["GradClamp", "ShapeLogger"]

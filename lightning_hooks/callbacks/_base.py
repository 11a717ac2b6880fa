"""What every hook callback shares: selection, the step gate and the hook lifecycle."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lightning.pytorch import Callback
from torch import nn
from typing_extensions import override

from lightning_hooks._handles import HookHandles
from lightning_hooks._select import ModuleSelector
from lightning_hooks._sink import Sink

if TYPE_CHECKING:
    import lightning.pytorch as pl


def check_positive_int(owner: str, arg: str, value: object, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        none = " or None (use the Trainer's `log_every_n_steps`)" if allow_none else ""
        raise ValueError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive integer{none}.")


def check_positive_float(owner: str, arg: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive finite number, e.g. 0.5.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive finite number.")
    return float(value)


class HookCallback(Callback):
    """Base of the callbacks: hooks attach in ``on_fit_start`` and leave on every exit path.

    Subclasses implement :meth:`_attach`, registering every handle with ``self._handles``.
    """

    def __init__(
        self,
        *,
        log_every_n_steps: int | None,
        include: list[str] | None,
        exclude: list[str] | None,
        types: list[str] | None,
        max_depth: int | None,
    ) -> None:
        owner = type(self).__name__
        check_positive_int(owner, "log_every_n_steps", log_every_n_steps)
        self.log_every_n_steps = log_every_n_steps
        self.selector = ModuleSelector(include, exclude, types, max_depth, owner=owner)
        self._handles = HookHandles()
        self._sink = Sink(owner)

    def every(self, trainer: pl.Trainer) -> int:
        """The logging period in optimizer steps."""
        return self.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50

    def is_logging_step(self, trainer: pl.Trainer) -> bool:
        """A training (not sanity-check) step whose optimizer step is a multiple of the period."""
        return trainer.training and not trainer.sanity_checking and trainer.global_step % self.every(trainer) == 0

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        self._handles.remove()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()
        self._attach(trainer, pl_module, self.selector.select(pl_module))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()

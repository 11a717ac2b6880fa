"""What a statistics callback adds to TensorBoard besides its scalars: the layout and the figures."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_hooks.sinks import figures as _figures
from lightning_hooks.sinks.sink import Sink
from lightning_hooks.stats.state import State

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["Dashboard", "FIGURE_PERIOD_FACTOR"]

Rows = Mapping[str, State]

FIGURES: dict[str, tuple[str, Callable[[Rows], tuple[list[Any], ...]], Callable[..., NDArray[np.uint8]]]] = {
    "grad_": ("figures/gradient_flow", _figures.gradient_flow_series, _figures.render_gradient_flow),
    "act_": ("figures/activation_zero_frac", _figures.zero_fraction_series, _figures.render_zero_fraction),
}
"""Which figure the moment rows logged under a tag prefix make: ``{prefix: (tag, series, render)}``."""

FIGURE_PERIOD_FACTOR = 10
"""Without ``figure_every_n_steps``, figures are drawn every this many logging periods..."""

FIGURE_TIME_SHARE = 0.01
"""... but no more often than keeps drawing them under this share of the fit's wall time."""


class Dashboard:
    """The custom-scalars layout and the figures of one statistics callback, written by :meth:`publish` after every
    training batch: figures of the rows from :meth:`add_rows` on multiples of the figure period, for image loggers."""

    def __init__(
        self, owner: str, sink: Sink, figure_every_n_steps: int | None, figures: bool = True, asked: bool = False
    ) -> None:
        self.owner, self.sink, self.figure_every_n_steps = owner, sink, figure_every_n_steps
        self.figures = figures
        self.asked = asked
        """Whether the user asked for figures (``figures=True`` or a period): only then is a missing matplotlib
        worth a warning."""
        self._rows: dict[str, Rows] = {}
        self._step: int | None = None
        self._can_draw = True
        self._skipped: tuple[int, dict[str, Rows]] | None = None
        self._next_draw = -math.inf  # time.monotonic() from which a default-period figure may be drawn

    def figure_every(self, log_every: int) -> int:
        """The figure period in optimizer steps, for a logging period of ``log_every``."""
        return self.figure_every_n_steps or FIGURE_PERIOD_FACTOR * log_every

    def start(self, log_every: int) -> None:
        """A fit starts: forget pending rows; warn if figures cannot fall on every figure period."""
        self.reset()
        self._skipped, self._next_draw = None, -math.inf
        every = self.figure_every(log_every)
        if self.figures and every % log_every:
            rank_zero_warn(
                f"`{self.owner}` got `figure_every_n_steps={every}`, which is not a multiple of the logging period "
                f"({log_every} steps); figures are drawn on logging steps only, so every {math.lcm(every, log_every)} "
                f"steps."
            )

    def reset(self) -> None:
        self._rows, self._step = {}, None

    def add_rows(self, prefix: str, rows: Rows, step: int) -> None:
        """The moment rows just logged under ``prefix`` at ``step``."""
        if prefix in FIGURES and rows:
            self._rows[prefix] = dict(rows)
        self._step = step

    def publish(self, trainer: pl.Trainer, log_every: int) -> None:
        """Write what the rows handed over since the last call make; a no-op on steps that logged nothing."""
        step, rows = self._step, self._rows
        self.reset()
        if step is None:
            return
        self.sink.layout(trainer, step)
        if not rows or not self.figures or step % self.figure_every(log_every) or not self._can_draw:
            return
        if not self.sink.wants_figures(trainer, warn=self.figure_every_n_steps is not None):
            return
        if self.figure_every_n_steps is None and time.monotonic() < self._next_draw:
            self._skipped = (step, rows)
            return
        self._draw(trainer, step, rows)

    def finish(self, trainer: pl.Trainer) -> None:
        """Training ended: draw the last figure the time budget skipped, if no later one was drawn."""
        if self._skipped is not None:
            self._draw(trainer, *self._skipped)

    def _draw(self, trainer: pl.Trainer, step: int, rows: Mapping[str, Rows]) -> None:
        self._skipped = None
        try:
            _figures.require()
        except ImportError:
            self._can_draw = False
            if self.asked:
                rank_zero_warn(
                    f"`{self.owner}` draws its figures with matplotlib, which is not installed; figures are "
                    f"skipped (everything else is logged). Install it: {_figures.INSTALL_HINT}."
                )
            return
        started = time.monotonic()
        for prefix, prefix_rows in rows.items():
            tag, series, render = FIGURES[prefix]
            layers, *values = series(prefix_rows)
            if layers:
                self.sink.image(trainer, tag, render(layers, *values, step), step)
            # A drawn figure is a web of reference cycles: collected now, the next figure reuses its memory.
            gc.collect()
        finished = time.monotonic()
        self._next_draw = finished + (finished - started) * (1 / FIGURE_TIME_SHARE - 1)

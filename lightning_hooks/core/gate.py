"""Which optimizer step is being recorded: the one gate every callback shares (pure Python)."""

from __future__ import annotations

__all__ = ["StepGate"]


class StepGate:
    """Opens on a due optimizer step (:meth:`begin`) and closes once the optimizer has stepped (:meth:`end`),
    handing back the recorded step.

    Example::

        >>> gate = StepGate()
        >>> gate.begin(step=0, due=True), gate.end(step=0)  # first micro-batch of step 0
        (True, None)
        >>> gate.begin(step=0, due=True), gate.end(step=1)  # the last one: the optimizer stepped
        (True, 0)
        >>> gate.begin(step=1, due=False)
        False
    """

    def __init__(self) -> None:
        self.step: int | None = None
        """The optimizer step being recorded, or ``None`` while closed."""

    @property
    def is_open(self) -> bool:
        return self.step is not None

    def begin(self, step: int, due: bool) -> bool:
        """A batch starts at optimizer step ``step``; open the gate if ``due``. Whether it is open."""
        if self.step is None and due:
            self.step = step
        return self.step is not None

    def end(self, step: int, force: bool = False) -> int | None:
        """A batch ended with the optimizer at ``step``: the recorded step if that closed it (or ``force``)."""
        if self.step is None or (step == self.step and not force):
            return None
        recorded, self.step = self.step, None
        return recorded

    def reset(self) -> None:
        self.step = None

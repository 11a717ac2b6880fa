"""A non-finite finding as data, and its rendering as a report (pure Python)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from lightning_hooks.core.select import label

__all__ = ["FINITE", "Finding", "Phase", "Reading", "first_finding", "with_parameters"]

FINITE, INF, NAN = 0, 1, 2
"""Severities: a NaN is worse than an Inf, which is worse than nothing."""

Phase = Literal["forward", "loss", "backward", "parameter"]

_SHOWN = 4
"""How many inputs, parameters or candidates a report lists before saying how many more."""


class Reading(NamedTuple):
    """What is known of one tensor: its range, its size and how many of its values are not finite."""

    min: float
    max: float
    numel: int
    nonfinite: int = 0

    @property
    def severity(self) -> int:
        """:data:`NAN`, :data:`INF` or :data:`FINITE`."""
        if math.isnan(self.min) or math.isnan(self.max):
            return NAN
        return INF if math.isinf(self.min) or math.isinf(self.max) else FINITE

    def range(self) -> str:
        return f"min {self.min:.4g}, max {self.max:.4g}"

    def bad(self) -> str:
        """``12 of 64 values are NaN`` (the kind shown is the worst present)."""
        return f"{self.nonfinite:,} of {self.numel:,} values are {'NaN' if self.severity == NAN else 'Inf'}"


@dataclass(frozen=True)
class Finding:
    """Where non-finite values appeared first, with what a user needs to look for the cause.

    Attributes:
        phase: ``forward`` (a module's output), ``loss`` (made after the model), ``backward``
            (a gradient with respect to a module's input) or ``parameter`` (only parameter
            gradients are non-finite).
        module: Qualified name of the module (``""`` is the model; empty for ``parameter``).
        module_type: Its class name.
        tensor: ``(path, reading)`` of the non-finite tensor: the output (forward), the loss, or
            the gradient with respect to an input (backward). ``path`` is the dotted path inside a
            nested structure, ``""`` for a bare tensor.
        given: What the module was given: its inputs (forward) or the gradients with respect to its
            outputs (backward), as ``(path, reading)``.
        made_here: Whether this module made the values from finite ones (``False``: they came
            from outside the selected modules, e.g. the batch, or code between modules).
        batch_idx: The batch index of the call.
        call: Which call of the module in the step (1-based), of ``calls``.
        calls: How many times the module was called in the step.
        shared_with: Other modules whose input is the same tensor; its gradient is the sum of
            theirs, so any of them may have made the value.
        parameters: ``(name, reading)`` of every parameter whose gradient is non-finite.
        step: The optimizer step (``0`` outside a Trainer).
        replayed: Whether it was found by replaying the step (``NonFiniteGuard(mode="replay")``).
        reproduced: ``False`` when the replay found every value finite although the step's loss
            (``phase="loss"``, ``tensor`` and ``batch_idx`` say which) or gradients were not.
        rank: The process that found it, under distributed training (``None`` in a single process).
        position: Where the call or gradient stands among those of the step, in the order they finished
            (forward) or were computed (backward): across processes that run the same modules (tensor
            parallelism), the lowest is where the values went wrong first.
    """

    phase: Phase
    module: str = ""
    module_type: str = ""
    tensor: tuple[str, Reading] | None = None
    given: tuple[tuple[str, Reading], ...] = ()
    made_here: bool = True
    batch_idx: int | None = None
    call: int = 1
    calls: int = 1
    shared_with: tuple[str, ...] = ()
    parameters: tuple[tuple[str, Reading], ...] = ()
    step: int = 0
    replayed: bool = False
    reproduced: bool = True
    rank: int | None = None
    position: int | None = None

    @property
    def layer(self) -> str:
        """The name a report goes under: the module's label, or ``parameters``."""
        return "parameters" if self.phase == "parameter" else label(self.module)

    def lines(self, step: int | None = None) -> list[str]:
        """The report, one fact a line, most important first."""
        who = f"`{label(self.module)}` ({self.module_type})"
        if self.calls > 1:
            who += f", call {self.call} of {self.calls}"
        path, reading = self.tensor or ("", Reading(math.nan, math.nan, 0))
        out = f"output `{path}`" if path else "output"
        lines: list[str] = []
        if self.phase == "forward":
            if self.made_here:
                lines.append(f"forward: {who} made non-finite values from finite inputs; {out}: {reading.bad()}")
            else:
                lines.append(
                    f"forward: no selected module made non-finite values from finite ones; they first appear in the "
                    f"{out} of {who}: {reading.bad()}"
                )
            lines.append(f"inputs{'' if self.made_here else ' (already non-finite)'}: {_ranges(self.given, 'input')}")
        elif self.phase == "loss" and not self.reproduced:
            lines.append(
                f"loss: the loss was non-finite ({reading.range()}) but the replay of the step found every value it "
                f"measured finite, the loss included: it did not reproduce (a non-deterministic kernel, or a batch "
                f"that `training_step` changes in place?)"
            )
        elif self.phase == "loss":
            lines.append(
                f"loss: every selected module's output was finite but the loss is not ({reading.range()}): "
                f"it was made after the selected modules, where the loss is computed"
            )
        elif self.phase == "backward":
            grad = f"the gradient w.r.t. its input `{path}`" if path else "the gradient w.r.t. its input"
            if self.made_here:
                lines.append(f"backward: {who} made {grad} non-finite from finite output gradients: {reading.bad()}")
                lines.append(f"gradients w.r.t. outputs: {_ranges(self.given, 'output')}")
                if self.shared_with:
                    lines.append(
                        f"that input is also the input of {_listed([f'`{n}`' for n in self.shared_with])}: "
                        f"its gradient is the sum of theirs, so any of these may have made it"
                    )
            else:
                lines.append(
                    f"backward: the gradient w.r.t. the {out} of {who} was already non-finite when it arrived "
                    f"({reading.bad()}): it was made after the selected modules, in the loss or in code between them"
                )
        if self.parameters:
            shown = _listed([f"`{name}` ({r.nonfinite:,} of {r.numel:,})" for name, r in self.parameters])
            lines.append(f"parameter gradients with NaN/Inf values: {shown}")
        where = [
            f"{k} {v}" for k, v in (("step", step), ("batch", self.batch_idx), ("rank", self.rank)) if v is not None
        ]
        if where:
            lines.append(", ".join(where))
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _ranges(tensors: Sequence[tuple[str, Reading]], what: str) -> str:
    if not tensors:
        return "none measured"
    shown = [f"{what} `{path}` {r.range()}" if path else f"{what} {r.range()}" for path, r in tensors[:_SHOWN]]
    more = [f"{len(tensors) - _SHOWN} more"] if len(tensors) > _SHOWN else []
    return "; ".join(shown + more)


def _listed(items: Sequence[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


_PHASES: tuple[Phase, ...] = ("forward", "loss", "backward", "parameter")


def first_finding(per_rank: Sequence[Finding | None]) -> Finding | None:
    """The finding every rank reports, from what each rank found (index = rank): reproduced before not, then by
    phase (forward, loss, backward, parameter), then the earliest :attr:`Finding.position`, then the lowest rank;
    it names its rank when there is more than one.

    Example::

        >>> first_finding([Finding("parameter"), Finding("forward", "fc")]).rank
        1
    """
    found = [
        ((not f.reproduced, _PHASES.index(f.phase), math.inf if f.position is None else f.position, rank), f)
        for rank, f in enumerate(per_rank)
        if f is not None
    ]
    if not found:
        return None
    (*_, rank), finding = min(found, key=lambda item: item[0])
    return replace(finding, rank=rank) if len(per_rank) > 1 else finding


def with_parameters(finding: Finding | None, parameters: tuple[tuple[str, Reading], ...]) -> Finding | None:
    """Add the non-finite parameter gradients to a finding, or make a ``parameter`` finding of them."""
    if not parameters:
        return finding
    return Finding("parameter", parameters=parameters) if finding is None else replace(finding, parameters=parameters)

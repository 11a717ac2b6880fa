"""Argument checks shared by every callback, each message in one voice (pure Python).

"`GradClamp` got `value=-1.0`; `value` must be a positive finite number."
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["boolean", "choice", "non_negative_int", "positive_float", "positive_int", "subset"]

T = TypeVar("T")

PERIOD_NONE = "use the Trainer's `log_every_n_steps`"


def positive_int(owner: str, arg: str, value: object, *, allow_none: bool = True, none: str = PERIOD_NONE) -> None:
    """A positive ``int`` (not a ``bool``), or ``None`` where ``allow_none``, which means ``none``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = f" or None ({none})" if allow_none else ""
        raise ValueError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive integer{hint}.")


def non_negative_int(owner: str, arg: str, value: object) -> int:
    """An ``int`` (not a ``bool``) that is 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be an integer of 0 or more, e.g. 1.")
    if value < 0:
        raise ValueError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be an integer of 0 or more.")
    return value


def positive_float(owner: str, arg: str, value: object) -> float:
    """A positive finite number, returned as a ``float``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive finite number, e.g. 0.5.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a positive finite number.")
    return float(value)


def boolean(owner: str, arg: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be True or False.")
    return value


def choice(owner: str, arg: str, value: object, allowed: Sequence[T]) -> T:
    """One of ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        quoted = [repr(a) for a in allowed]
        names = " or ".join(quoted) if len(quoted) <= 2 else "one of " + ", ".join(quoted)
        raise ValueError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be {names}.")
    return value  # type: ignore[return-value]


def subset(owner: str, arg: str, value: object, allowed: Sequence[str]) -> list[str] | None:
    """A non-empty list drawn from ``allowed``, or ``None`` (all of them)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"`{owner}` got `{arg}={value!r}`; `{arg}` must be a list drawn from {list(allowed)}.")
    if not value or any(v not in allowed for v in value):
        raise ValueError(
            f"`{owner}` got `{arg}={list(value)!r}`; `{arg}` must be a non-empty list drawn from {list(allowed)}, "
            f"or None for all of them."
        )
    return list(value)

"""Observing hooks inside ``torch.compile``'d regions: registered once per fit, switched by a flag (pure torch).

Dynamo keeps a quiet graph and a logging one, whose statistics come out in a :class:`Pending`. During a fit a
region runs through a fresh entry point, compiled anew with the hooks; the last :meth:`Region.leave` restores it.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from lightning_hooks.core.handles import Observer
from lightning_hooks.core.select import is_compile_wrapper
from lightning_hooks.stats.batch import Key, StatBatch, sample
from lightning_hooks.stats.state import RAW_WIDTH, raw_rows, real_view

__all__ = ["Pending", "Region", "Regions", "Settles", "Switched", "eager_stance", "has_compiled", "run_eager"]

_STEP_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")
"""What Lightning compiles on a LightningModule passed to ``fit`` as ``torch.compile(model)``."""


class Switch:
    """A flag that is on while any of its voters asks for it: one per compiled region, on while some callback
    records the step (dynamo guards on ``on``), and one for :func:`run_eager`."""

    def __init__(self) -> None:
        self.on = False
        self._voters: set[int] = set()

    def vote(self, voter: object, on: bool) -> None:
        if on:
            self._voters.add(id(voter))
        else:
            self._voters.discard(id(voter))
        self.on = bool(self._voters)

    def reset(self) -> None:
        self._voters.clear()
        self.on = False


class Switched:
    """A module hook that calls ``hook`` only while ``switch.on`` and observers are awake (see
    :func:`~lightning_hooks.core.handles.observers_asleep`); traceable, so dynamo inlines it."""

    def __init__(self, switch: Switch, hook: Callable[..., Any]) -> None:
        self.switch, self.hook = switch, hook

    def __call__(self, *args: Any) -> Any:
        return self.hook(*args) if self.switch.on and not Observer.asleep else None


class Pending:
    """States computed inside compiled graphs by :meth:`add` (:meth:`StatBatch.add`'s signature), waiting for the
    step to end. Traced code only appends to ``rows`` and ``fired``, which the region empties after each call
    (:meth:`settle`), so nothing recompiles."""

    def __init__(self) -> None:
        self.rows: list[tuple[Key, torch.Tensor, int, torch.Tensor | None]] = []
        self.fired: list[str] = []
        self._settled: list[tuple[Key, torch.Tensor, int, torch.Tensor | None]] = []
        self._ran: set[str] = set()

    def add(self, key: Key, t: torch.Tensor, histogram: bool = False) -> None:
        # Only the reduction is traced, over the whole tensor at once (inductor fuses it, with no copy to split);
        # the states are made from the rows at the fetch, all together, outside the graph.
        x = real_view(t.detach())
        n = x.numel()
        raw = raw_rows(x.reshape(1, -1)) if n else x.new_zeros(1, RAW_WIDTH, dtype=torch.float32)
        self.rows.append((key, raw, n, sample(t) if histogram else None))

    def settle(self) -> None:
        """After a call of the region: keep what it produced apart from what the next call will."""
        if self.rows or self.fired:
            self._settled.extend(self.rows)
            self._ran.update(self.fired)
            self.rows, self.fired = [], []

    def pour(self, batch: StatBatch, fired: set[str]) -> None:
        """Hand everything to ``batch`` (which takes it only if open), the names that ran to ``fired``; forget it."""
        if not (self._settled or self._ran or self.rows or self.fired):  # every quiet step
            return
        self.settle()
        rows, self._settled = self._settled, []
        fired.update(self._ran)
        self._ran = set()
        for key, raw, n, sampled in rows:
            batch.add_raw(key, raw, n, sampled)

    def clear(self) -> None:
        self.rows, self.fired, self._settled, self._ran = [], [], [], set()


class Settles(Protocol):
    """What traced hooks leave behind and a region settles after each call (:class:`Pending`, the shape rows)."""

    def settle(self) -> None: ...


class _Entry:
    """A region's entry point during a fit: its compiled function, then each :class:`Settles` settled."""

    def __init__(self, compiled: Callable[..., Any], pendings: list[Settles], wrapped: Callable[..., Any]) -> None:
        self.compiled, self.pendings = compiled, pendings
        self.__wrapped__ = wrapped  # what Lightning's `is_overridden` reads

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        finally:
            for pending in self.pendings:
                pending.settle()


class Region:
    """One compiled part of a model and the switch of the hooks inside it: ``owner`` is the ``OptimizedModule`` or
    the compiled LightningModule, ``module`` the module whose code is compiled; both held weakly."""

    def __init__(self, owner: nn.Module, module: nn.Module) -> None:
        self._owner = weakref.ref(owner)
        self._module = weakref.ref(module)
        self.switch = Switch()
        self.users = 0
        self.pendings: list[Settles] = []  # see settles()
        self._saved: dict[str, Any] = {}
        self._members = {id(m) for m in module.modules()}

    def settles(self, pending: Settles) -> None:
        """Settle ``pending`` after each call of the region (see :class:`Pending`)."""
        if all(p is not pending for p in self.pendings):
            self.pendings.append(pending)

    def __contains__(self, module: nn.Module) -> bool:
        return id(module) in self._members

    def enter(self) -> None:
        self.users += 1
        owner, module = self._owner(), self._module()
        if self.users > 1 or owner is None or module is None:
            return
        if is_compile_wrapper(owner):
            attr = "_forward" if "_forward" in owner.__dict__ else "forward"  # lazy modules check first
            self._saved = {attr: owner.__dict__[attr]}
            call = _switched(module, self.switch)
            setattr(owner, attr, _Entry(owner.dynamo_ctx(call), self.pendings, call))  # type: ignore[operator]
            return
        ctx: dict[str, Any] = owner.__dict__["_compiler_ctx"]
        for method in _STEP_METHODS:
            original = ctx.get(f"original_{method}")
            if original is not None and method in owner.__dict__:
                self._saved[method] = owner.__dict__[method]
                compiled = ctx["dynamo_ctx"](_switched(original, self.switch))
                setattr(owner, method, _Entry(compiled, self.pendings, _fresh(original)))

    def leave(self) -> None:
        self.users = max(self.users - 1, 0)
        owner = self._owner()
        if self.users or owner is None:
            return
        saved, self._saved = self._saved, {}
        for attr, value in saved.items():
            setattr(owner, attr, value)
        self.switch.reset()
        self.pendings.clear()


_REGIONS: weakref.WeakKeyDictionary[nn.Module, Region] = weakref.WeakKeyDictionary()
"""The region of each compiled wrapper or LightningModule, shared by every callback that hooks into it."""


def find_regions(model: nn.Module) -> list[Region]:
    """The compiled regions of ``model``, outermost first (a region inside another is not listed)."""
    found: list[Region] = []
    for module in model.modules():
        if any(module in r for r in found):
            continue
        if is_compile_wrapper(module):
            inner: nn.Module = getattr(module, "_orig_mod")  # noqa: B009 (typed as a Tensor or a Module)
        elif isinstance(getattr(module, "_compiler_ctx", None), dict):
            inner = module
        else:
            continue
        region = _REGIONS.get(module)
        if region is None or not region.users:  # made afresh for each fit: a model can change between fits
            region = _REGIONS[module] = Region(module, inner)
        found.append(region)
    return found


class Regions:
    """The regions a callback has entered in a fit, and the split of its modules between them and eager code."""

    def __init__(self) -> None:
        self.entered: list[Region] = []

    def enter(
        self, model: nn.Module, modules: Sequence[tuple[str, nn.Module]]
    ) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module, Region]]]:
        """Enter the regions of ``model`` that hold some of ``modules``; :meth:`split` ``modules`` between them."""
        self.leave()
        self.entered = [r for r in find_regions(model) if any(m in r for _, m in modules)]
        for region in self.entered:
            region.enter()
        return self.split(modules)

    def leave(self) -> None:
        entered, self.entered = self.entered, []
        for region in entered:
            region.leave()

    def split(
        self, modules: Sequence[tuple[str, nn.Module]]
    ) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module, Region]]]:
        """``(eager, compiled)``: the modules outside any region, and those inside one with their region."""
        found = [(name, module, next((r for r in self.entered if module in r), None)) for name, module in modules]
        return [(n, m) for n, m, r in found if r is None], [(n, m, r) for n, m, r in found if r is not None]

    def vote(self, voter: object, on: bool) -> None:
        for region in self.entered:
            region.switch.vote(voter, on)


def _switched(func: Callable[..., Any], switch: Switch) -> types.FunctionType:
    """``func`` behind a test of ``switch``, in code of its own (see :func:`_fresh`).

    The test puts a guard on the switch into every graph of the region. The hooks' own reads of it do that too,
    unless they run inside activation checkpointing. There a recording hook's side effect breaks the graph while the
    switch is on, and dynamo falls back to calling the region eagerly, with no guard. Without the test the quiet
    steps would then reuse that fallback for the rest of the fit.
    """

    def compiled_region(*args: Any, **kwargs: Any) -> Any:
        if switch.on:
            return func(*args, **kwargs)
        return func(*args, **kwargs)

    return _fresh(compiled_region)


def _fresh(func: Any) -> Any:
    """``func`` (a function, or a method bound again) with a code object of its own: a cache of compiled code that
    nothing else shares."""
    if isinstance(func, types.MethodType):
        return types.MethodType(_fresh(func.__func__), func.__self__)
    code = func.__code__.replace()
    fresh = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    fresh.__kwdefaults__ = func.__kwdefaults__
    fresh.__qualname__ = func.__qualname__
    return fresh


_EAGER = Switch()
_EAGER_STANCE: list[Any] = []
"""The ``set_stance`` object in force while :data:`_EAGER` is on (at most one)."""


def run_eager(voter: object, on: bool) -> None:
    """While any voter asks for it, every compiled function runs eagerly (``torch.compiler.set_stance("force_eager")``);
    the stance in force before the first vote comes back with the last."""
    _EAGER.vote(voter, on)
    if _EAGER.on and not _EAGER_STANCE:
        _EAGER_STANCE.append(torch.compiler.set_stance("force_eager"))
    elif not _EAGER.on and _EAGER_STANCE:
        _EAGER_STANCE.pop().__exit__(None, None, None)


def has_compiled(model: nn.Module, modules: Sequence[tuple[str, nn.Module]]) -> bool:
    """Whether some of ``modules`` are inside a compiled region of ``model``."""
    return any(module in region for region in find_regions(model) for _, module in modules)


def eager_stance() -> Any:
    """A context in which every compiled function runs eagerly (a replayed step, whose hooks must fire)."""
    return torch.compiler.set_stance("force_eager")

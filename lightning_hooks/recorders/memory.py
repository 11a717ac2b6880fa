"""Where the memory of one training step goes, module by module, with torch's own ``MemTracker`` (pure torch).

``MemTracker`` attributes every tensor the step allocates to a kind (parameter, gradient, activation, temporary,
optimizer state) and keeps each module's peak; it says which module *allocated* a tensor, not which one keeps it for
backward. What a module keeps is what autograd saves while its forward runs (``saved_tensors_hooks``): the memory
that activation checkpointing of that module would give back. :class:`MemoryRecorder` records both.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState, _UpdateType, _WeakRefInfo
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_leaves

from lightning_hooks.core.autograd import in_backward
from lightning_hooks.core.handles import HookHandles
from lightning_hooks.core.select import label, type_label
from lightning_hooks.core.shards import is_sharded, local

__all__ = ["MemoryRecorder", "MemoryRow", "StepMemory", "record_step", "storage_bytes"]

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default

FORWARD, BACKWARD, OPTIMIZER, OUTSIDE = "forward", "backward", "optimizer step", "training_step, outside any module"


@dataclass(frozen=True)
class MemoryRow:
    """The bytes of one selected module during the recorded step, each inclusive of its children.

    ``activations`` are what autograd keeps for backward from the module's forward (its saved tensors, parameters
    left out), ``temporaries`` the most its backward had live beyond what it started with, ``peak`` the most the
    whole step had live while the module's forward or backward ran.
    """

    name: str
    type: str
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    peak: int


@dataclass(frozen=True)
class StepMemory:
    """What one recorded step says: a row per selected module, the step's peak and where it happened."""

    rows: list[MemoryRow]
    peak: int
    peak_at: str
    optimizer_state: int
    """Bytes of every optimizer's state after the step."""
    activations: int
    """Bytes of everything autograd saved for backward in the step, in modules or not."""
    inputs: dict[str, int] = field(default_factory=dict)
    """Bytes of each selected module's first call's tensor inputs (what checkpointing it would keep)."""


def _storages(tensors: Iterable[object]) -> Iterator[torch.UntypedStorage]:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            yield (local(t) if is_sharded(t) else t).untyped_storage()


def storage_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the storages behind ``tensors`` (the local shard of a ``DTensor``), each storage counted once."""
    seen: dict[int, int] = {}
    for storage in _storages(tensors):
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _NoHook:
    """What :meth:`_Guarded.skip_frozen` puts in place of a gradient hook's handle: nothing to remove."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class _Guarded(MemTracker):
    """A tracker that never fails the step: the first error of its own bookkeeping is kept in ``failure`` and from
    then on it only runs the operations (an error of an operation itself still raises).

    Its work after each operation is torch's, done with less Python: the outputs' storages are looked up without a
    pytree map, and the running modules' peaks are only revisited when the step's memory passed the most it had since
    a module last began or ended. What each kind of work cost: docs/performance.md, "MemoryLogger".
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.failure: BaseException | None = None
        self._fake_mode_on_entry: Any = None  # torch 2.13's __enter__ sets it; before 2.13 nothing does (eager: None)
        self._by_name: dict[str, list[Any]] = {}  # each module's stats, by its name
        self._indexed = 0  # how many of ``memory_tracking`` are in ``_by_name``
        self._high: tuple[Any, dict[torch.device, int]] = (None, {})  # the peak state, the most seen since, by device

    def _guard(self, hook: Callable[..., None], *args: Any) -> None:
        self._high = (None, {})  # a module began or ended: its peak starts again
        if self.failure is None:
            try:
                hook(*args)
            except Exception as error:
                self.failure = error

    def _pre_fw_hook(self, module: nn.Module, *args: Any) -> None:
        new = module not in self.memory_tracking
        self._guard(super()._pre_fw_hook, module, *args)
        if new and module in self.memory_tracking:  # index it by name now, not by a walk over every module later
            stats = self.memory_tracking[module]
            self._by_name.setdefault(stats.mod_fqn, []).append(stats)
            self._indexed += 1

    def _post_fw_hook(self, *args: Any) -> None:
        self._guard(super()._post_fw_hook, *args)

    # A module made and dropped inside the forward (T5 makes its CrossEntropyLoss there) is gone when backward gets
    # to it: torch's hooks would only warn, once per module and direction.
    def _pre_bw_hook(self, module: nn.Module | None, *args: Any) -> None:
        if module is not None:
            self._guard(super()._pre_bw_hook, module, *args)

    def _post_bw_hook(self, module: nn.Module | None, *args: Any) -> None:
        if module is not None:
            self._guard(super()._post_bw_hook, module, *args)

    def _track(self, *args: Any) -> None:
        self._guard(super()._track, *args)

    def _update_peak_stats(self, *args: Any) -> None:
        self._guard(self._update_running_peaks, *args)

    def get_tracker_snapshot(self, type: str = "current") -> dict[torch.device, dict[str, int]]:
        if type == "current":  # what torch's deepcopy of ints in dicts in a dict makes, with less Python
            return {device: dict(snap) for device, snap in self._curr_mem_snap.items()}
        return super().get_tracker_snapshot(type)

    def _track_plain(self, reftype: Any, t: torch.Tensor) -> None:
        """torch's ``_track`` for a tensor with one storage of its own (not a wrapper subclass)."""
        storage = t.untyped_storage()
        found = self._WINFO.get(storage)
        if found is None:
            winfo, ref = _WeakRefInfo.create_winfo(storage, t.device, reftype, self._delete_callback)
            self._WINFO[storage] = (winfo, ref)
            if winfo.mem_consumed > 0:
                self._update_snap(_UpdateType.ADD, winfo)
        elif found[0].size != storage.size():
            MemTracker._track(self, reftype, t)

    def _update_running_peaks(self, peak_state: Any) -> None:
        """What torch's ``_update_peak_stats`` does after every operation, over the modules running now instead of
        every module seen so far: the same peaks, at a cost per operation that grows with the model's depth rather
        than its size (torch's loop made a 24-layer encoder's recorded step 90 times a plain one)."""
        current = self._curr_mem_snap  # per device, kinds to ints: a shallow copy (torch deep-copies) is a full one
        state, high = self._high
        if state is peak_state and all(snap[_TOTAL] <= high.get(device, -1) for device, snap in current.items()):
            return  # no module's peak can have moved since the last look
        self._high = (peak_state, {device: snap[_TOTAL] for device, snap in current.items()})
        if self._indexed != len(self.memory_tracking):  # modules FSDPMemTracker found in its own hooks
            self._by_name, self._indexed = {}, len(self.memory_tracking)
            for stats in self.memory_tracking.values():
                self._by_name.setdefault(stats.mod_fqn, []).append(stats)
        for name in self._mod_tracker.parents:
            for stats in self._by_name.get(name, ()):
                if peak_state in stats.snapshots:
                    for device, snap in current.items():
                        if stats.local_peak.get(device, 0) < snap[_TOTAL]:
                            stats.local_peak[device] = snap[_TOTAL]
                            stats.snapshots[peak_state][-1][device] = dict(snap)
        for device, snap in current.items():
            if self._peak_mem.get(device, 0) < snap[_TOTAL]:
                self._peak_mem[device] = snap[_TOTAL]
                self._peak_mem_snap[device] = dict(snap)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # torch's MemTracker.__torch_dispatch__, with the same decisions, without a pytree map and a partial per call.
        if DTensor in types:
            return NotImplemented  # DTensor runs first and comes back with its local tensors
        if self.failure is not None:
            return func(*args, **(kwargs or {}))
        if func is _WAIT_TENSOR:
            return super().__torch_dispatch__(func, types, args, kwargs)  # torch's own case for fake collectives
        out = func(*args, **(kwargs or {}))
        try:
            if active_fake_mode() is not self._fake_mode_on_entry:
                return out  # DTensor's sharding propagation, not memory of the step
            backward = self._mod_tracker.is_bw
            if self._in_opt:
                reftype = _MemRefType.OPT
            else:
                reftype = _MemRefType.TEMP if backward and not self._in_ac else _MemRefType.ACT
            for t in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
                if type(t) is torch.Tensor or type(t) is nn.Parameter:
                    self._track_plain(reftype, t)
                elif isinstance(t, torch.Tensor):
                    MemTracker._track(self, reftype, t)
            self._update_running_peaks(_ModState.PEAK_BW if backward else _ModState.PEAK_FW)
        except Exception as error:
            self.failure = error
        return out

    def track(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], tensors: list[torch.Tensor]) -> None:
        """Count what exists before the step: the model, the optimizers' state, the batch's ``tensors``."""
        self.skip_frozen(model)
        self.track_external(model, *optimizers, *tensors)

    def skip_frozen(self, model: nn.Module) -> None:
        """Give each frozen parameter of ``model`` an entry among torch's gradient hooks that hooks nothing.

        torch's tracker registers a gradient hook on every parameter of a module as the module first runs, and
        ``register_hook`` raises on a parameter that does not require a gradient: a frozen backbone, LoRA's base
        weights, Whisper's positional embeddings. The tracker skips a parameter that already has an entry.
        """
        for param in model.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)


class _FSDPGuarded(_Guarded, FSDPMemTracker):
    """:class:`_Guarded` for a model sharded with FSDP2, which knows its own parameters and gradients."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.failure is not None:
            return func(*args, **(kwargs or {}))
        return FSDPMemTracker.__torch_dispatch__(self, func, types, args, kwargs)

    def track(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], tensors: list[torch.Tensor]) -> None:
        self.skip_frozen(model)
        # The optimizer is not handed to FSDPMemTracker, whose step hooks would count the closure (forward and
        # backward) as optimizer state; its state is counted as existing memory, as the batch is.
        states = [v for opt in optimizers for state in opt.state.values() for v in state.values()]
        self.track_inputs((tensors, [local(t) for t in states if torch.is_tensor(t)]))


def _tracker(model: nn.Module) -> _Guarded:
    return _FSDPGuarded(model) if isinstance(model, FSDPModule) else _Guarded()


def _by_name(snapshot: dict[Any, int]) -> dict[str, int]:
    """A device's snapshot keyed by the kinds' names (``"Activation"``, ``"Total"``)."""
    return {str(getattr(kind, "value", kind)): n for kind, n in snapshot.items()}


def _phase_snapshots(stats: Any, state: str, device: torch.device) -> list[dict[str, int]]:
    """The module's snapshots in ``state`` (``"Peak-Forward"``, ...) on ``device``, one per call."""
    found = [calls for key, calls in stats.snapshots.items() if getattr(key, "value", key) == state]
    return [_by_name(call.get(device, {})) for calls in found for call in calls]


class _SavedBy:
    """Which storages autograd saves while each hooked module's forward runs: a module stack kept by forward hooks,
    and a pack hook that adds the saved tensor's storage (its pointer and size, never the tensor) to every module
    on the stack."""

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip  # parameters and buffers: not activations
        self.stack: list[str] = []
        self.saved: dict[str, dict[int, int]] = {}
        self.total: dict[int, int] = {}
        self.inputs: dict[str, int] = {}

    def pre(self, name: str) -> Callable[..., None]:
        def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if in_backward():
                return
            self.stack.append(name)
            self.saved.setdefault(name, {})
            self.inputs.setdefault(name, storage_bytes(tree_flatten((args, kwargs))[0]))

        return enter

    def post(self, name: str) -> Callable[..., None]:
        def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not in_backward() and self.stack and self.stack[-1] == name:
                self.stack.pop()

        return leave

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" and not in_backward():
            storage = (local(t) if is_sharded(t) else t).untyped_storage()  # a DTensor's own part
            ptr = storage.data_ptr()
            if ptr not in self.skip:
                self.total[ptr] = storage.nbytes()
                for name in self.stack:
                    self.saved[name][ptr] = storage.nbytes()
        return t

    def bytes(self, name: str) -> int:
        return sum(self.saved.get(name, {}).values())


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class MemoryRecorder:
    """Records one training step of ``model``: enter :meth:`start` before its forward, :meth:`stop` after the
    optimizer stepped; :meth:`result` says what it saw. ``modules`` are the selected ``(name, module)`` pairs."""

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]], handles: HookHandles) -> None:
        self.model, self.modules, self.handles = model, modules, handles
        self.tracker: _Guarded | None = None
        self._entered = False
        self.before_update: int | None = None
        """The step's peak when the optimizer's update began (after backward)."""
        skip = {s.data_ptr() for s in _storages([*model.parameters(), *model.buffers()])}
        self.saved = _SavedBy(skip)
        self._saving: Any = None
        self._batch: Any = ()
        self._collector: bool | None = None  # whether Python's cyclic collector ran before start paused it

    @property
    def failure(self) -> BaseException | None:
        return None if self.tracker is None else self.tracker.failure

    def start(self, optimizers: list[torch.optim.Optimizer], batch: Any = None) -> None:
        """Enter a fresh tracker that knows the model, ``optimizers`` and the tensors of ``batch``; hook the
        selected modules (once).

        Python's cyclic collector waits until :meth:`close`: the tracker makes tens of thousands of objects, enough to
        set off a collection of the whole heap in the middle of the step (a quarter of the recorded step on a 24-layer
        encoder); :meth:`close` collects what the step left, and only that.
        """
        if self._collector is None:
            self._collector = gc.isenabled()
            gc.disable()
        tracker = self.tracker = _tracker(self.model)
        self._batch = batch = self._batch if batch is None else batch
        tracker.track(self.model, optimizers, [t for t in tree_flatten(batch)[0] if torch.is_tensor(t)])
        tracker.__enter__()
        self._entered = True
        if not len(self.handles):
            self.handles.add_forward_pre_hooks([(m, self.saved.pre(n)) for n, m in self.modules], with_kwargs=True)
            self.handles.add_forward_hooks([(m, self.saved.post(n)) for n, m in self.modules], always_call=True)
            self._saving = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, _unpack)
            self._saving.__enter__()

    def restart_unless_forward_ran(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """At the start of an optimizer's step: when no forward ran yet, the step's closure runs forward and backward
        inside ``optimizer.step`` and the tracker, whose optimizer hook just fired, would count all of it as
        optimizer state; a fresh tracker, entered after that hook, counts them as what they are."""
        if self.tracker is not None and self._entered and not self.tracker.memory_tracking:
            self._entered = False
            self.tracker.__exit__(None, None, None)
            self.start(optimizers)

    def optimizer_begins(self) -> None:
        """Backward is over; what comes is the optimizer's update."""
        if self.tracker is not None:
            self.before_update = self._peak()

    def stop(self) -> None:
        """Leave the tracker and remove every hook; safe to call more than once."""
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.__exit__(None, None, None)
        self.handles.remove()
        self.saved.stack.clear()
        self._batch = ()
        if self.tracker is not None and self._entered:
            self._entered = False
            self.tracker.__exit__(None, None, None)

    def finish(self, optimizers: list[torch.optim.Optimizer]) -> StepMemory:
        """:meth:`stop`, :meth:`result` and :meth:`close`; raises the tracker's own failure if it had one."""
        try:
            self.stop()
            if self.failure is not None:
                raise self.failure
            return self.result(optimizers)
        finally:
            self.close()

    def close(self) -> None:
        """:meth:`stop`, then let the tracker go: its objects, cycles among them, are collected before the
        collector runs again as it did; safe to call more than once. :meth:`result` can no longer be read."""
        self.stop()
        self.tracker = None
        self._resume_collector(collect=True)

    def _resume_collector(self, collect: bool) -> None:
        if self._collector is not None:
            collector, self._collector = self._collector, None
            if collect:
                gc.collect(0)  # the youngest generation: everything made since start, and nothing older
            if collector:
                gc.enable()

    def _device_snapshot(self, kind: str) -> dict[str, int]:
        assert self.tracker is not None
        snapshot = self.tracker.get_tracker_snapshot(kind)
        device = self._device()
        return _by_name(snapshot.get(device, {})) if device in snapshot else {}

    def _device(self) -> torch.device:
        tensor = next(iter([*self.model.parameters(), *self.model.buffers()]), None)
        return local(tensor).device if tensor is not None else torch.device("cpu")

    def _peak(self) -> int:
        return self._device_snapshot("peak").get("Total", 0)

    def result(self, optimizers: list[torch.optim.Optimizer]) -> StepMemory:
        """The rows, the peak and where it happened; call after :meth:`stop`."""
        assert self.tracker is not None
        self.tracker.track_external(*optimizers)  # what the update created is optimizer state
        device, peak = self._device(), self._peak()
        state_of = {
            id(p): [v for v in opt.state.get(p, {}).values() if torch.is_tensor(v)]
            for opt in optimizers
            for group in opt.param_groups
            for p in group["params"]
        }
        rows, peaks = [], []
        for name, module in self.modules:
            params = list(module.parameters())
            stats = self.tracker.memory_tracking.get(module)
            fw = _phase_snapshots(stats, "Peak-Forward", device) if stats else []
            bw = _phase_snapshots(stats, "Peak-Backward", device) if stats else []
            pre_bw = _phase_snapshots(stats, "Pre-Backward", device) if stats else []
            temps = [b.get("Temp", 0) - a.get("Temp", 0) for a, b in zip(pre_bw, bw, strict=False)]
            top_fw, top_bw = (
                max((s.get("Total", 0) for s in fw), default=0),
                max((s.get("Total", 0) for s in bw), default=0),
            )
            peaks.append((name, FORWARD if top_fw >= top_bw else BACKWARD, max(top_fw, top_bw)))
            rows.append(
                MemoryRow(
                    name=name,
                    type=type_label(module),
                    parameters=storage_bytes(params),
                    gradients=storage_bytes(p.grad for p in params),
                    optimizer_state=storage_bytes(t for p in params for t in state_of.get(id(p), [])),
                    activations=self.saved.bytes(name),
                    temporaries=max([0, *temps]),
                    peak=max(top_fw, top_bw),
                )
            )
        at = [(name, phase) for name, phase, top in peaks if top == peak and peak > 0]
        if at:
            name, phase = max(at, key=lambda a: (a[0] != "") + a[0].count("."))  # the innermost
            peak_at = f"{label(name)} ({phase})"
        else:
            late = self.before_update is not None and peak > self.before_update
            peak_at = OPTIMIZER if late else OUTSIDE
        opt_bytes = storage_bytes(t for states in state_of.values() for t in states)
        activations = sum(self.saved.total.values())
        return StepMemory(rows, peak, peak_at, opt_bytes, activations, dict(self.saved.inputs))


@contextmanager
def record_step(
    model: nn.Module, modules: list[tuple[str, nn.Module]], optimizers: list[torch.optim.Optimizer], *batch: Any
) -> Iterator[MemoryRecorder]:
    """Record what runs inside the block (forward, backward, ``optimizer.step()``) as one step; no hook and no
    tracker outlives it. :meth:`MemoryRecorder.result` reads it after the block."""
    recorder = MemoryRecorder(model, modules, HookHandles())
    recorder.start(optimizers, batch)
    try:
        yield recorder
    finally:
        recorder.stop()
        recorder._resume_collector(collect=False)  # the tracker stays for result()

"""Finding the first module that made a NaN or an Inf, forward or backward (pure torch)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_hooks.core.autograd import in_backward, in_transform
from lightning_hooks.core.handles import HookHandles
from lightning_hooks.core.nested import call_inputs, named_tensors
from lightning_hooks.core.select import ModuleSelector, type_label
from lightning_hooks.core.shards import local
from lightning_hooks.diagnose.finding import FINITE, NAN, Finding, Phase, Reading
from lightning_hooks.stats.state import flat_pieces, nonfinite_count, real_view

__all__ = [
    "NonFiniteRecorder",
    "find_nonfinite",
    "finite_step",
    "grad_readings",
    "nonfinite_flag",
    "parameter_readings",
]


class Readings:
    """Readings taken on the tensors' devices, read on the host with one transfer.

    Example::

        >>> readings = Readings()
        >>> slot = readings.take(torch.tensor([1.0, float("inf"), -2.0]))
        >>> readings.read()[0][slot]
        Reading(min=-2.0, max=inf, numel=3, nonfinite=1)
    """

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []

    def __len__(self) -> int:
        return len(self._items)

    def take(self, t: torch.Tensor) -> int | None:
        """Queue a reading of ``t``; its index in :meth:`read`, or ``None`` (counted as finite) if ``t`` is not
        a dense floating-point tensor with values."""
        if not (t.is_floating_point() and t.layout == torch.strided and t.numel()):
            return None
        x = local(t.detach())  # a DTensor's own part: a NaN anywhere is in some process's part
        low, high = torch.aminmax(x)
        self._items.append((low, high, nonfinite_count(x), x.numel()))
        return len(self._items) - 1

    def read(self, extra: Sequence[torch.Tensor] = ()) -> tuple[list[Reading], list[float]]:
        """Every reading, and the 0-d tensors ``extra`` as floats, with one device-to-host copy."""
        bounds = [b for item in self._items for b in item[:2]]
        counts = [item[2] for item in self._items]
        flat: list[float] = []
        tensors = [*bounds, *counts, *extra]
        if tensors:
            device = tensors[0].device
            # Stack each kind apart: a count must not be cast to a half-precision bound's dtype.
            parts = [torch.stack([t.to(device) for t in group]).double() for group in (bounds, counts, extra) if group]
            flat = torch.cat(parts).tolist()
        n = len(self._items)
        readings = [
            Reading(flat[2 * k], flat[2 * k + 1], item[3], int(flat[2 * n + k])) for k, item in enumerate(self._items)
        ]
        return readings, flat[3 * n :]


@dataclass
class _Call:
    """One call of one module: where its inputs' and outputs' readings are."""

    name: str
    type: str
    batch_idx: int | None
    inputs: list[tuple[str, int]] = field(default_factory=list)
    outputs: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class _Seen:
    """A tensor met during the step: its reading and the group of its gradient hook."""

    ref: weakref.ref[torch.Tensor]
    version: int
    slot: int | None
    group: int | None = None


def _worst(slots: Sequence[tuple[str, int]], readings: Sequence[Reading]) -> int:
    return max((readings[slot].severity for _, slot in slots), default=FINITE)


class NonFiniteRecorder:
    """Record, per module call and per gradient, whether the values were finite; find the first that was not.

    While ``active``, every floating-point tensor a hooked call receives or returns (and its gradient) is
    reduced on device to its range and count of non-finite values; :meth:`find` reads everything recorded
    since the last :meth:`clear` with one transfer. Numbers and weak references are kept, never a tensor.

    Args:
        check_backward: Also watch gradients with respect to module inputs and outputs.
    """

    def __init__(self, check_backward: bool = True) -> None:
        self.check_backward = check_backward
        self.active = False
        self.batch_idx: int | None = None
        self.generation = 0
        self.keep: list[torch.Tensor] | None = None
        """While a list (a replay), every tensor whose gradient is watched, for backward to compute exactly those."""
        self.clear()

    def clear(self) -> None:
        """Forget the step; gradient hooks still pending from it will do nothing."""
        self.generation += 1
        self.readings = Readings()
        self.calls: list[_Call] = []
        self.finished: list[int] = []
        self.groups: list[list[tuple[int, str, bool]]] = []
        """Per tensor whose gradient is watched, the roles it plays: ``(call, path, is_output)``."""
        self.events: list[tuple[int, int]] = []
        self.losses: list[int] = []
        self._open: dict[str, list[int]] = {}
        self._seen: dict[int, _Seen] = {}

    def __len__(self) -> int:
        """How many tensors have been measured since the last :meth:`clear`."""
        return len(self.readings)

    def __getstate__(self) -> dict[str, Any]:
        return {"check_backward": self.check_backward, "generation": self.generation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, active=False, batch_idx=None, keep=None)
        self.clear()

    def attach(self, modules: Sequence[tuple[str, nn.Module]], handles: HookHandles) -> None:
        for name, module in modules:
            handles.add(module.register_forward_pre_hook(_Enter(self, name, type_label(module)), with_kwargs=True))
            handles.add(module.register_forward_hook(_Exit(self, name)))

    def record_loss(self, loss: torch.Tensor) -> None:
        if (slot := self.readings.take(loss)) is not None:
            self.losses.append(slot)

    def _watch(self, t: torch.Tensor, seen: _Seen, call: int, path: str, output: bool) -> None:
        if seen.group is None:
            seen.group = len(self.groups)
            self.groups.append([])
            t.register_hook(_GradProbe(self, seen.group, self.generation))
            if self.keep is not None:
                self.keep.append(t)
        self.groups[seen.group].append((call, path, output))

    def _record(self, tensors: list[tuple[str, torch.Tensor]], call: int, output: bool) -> None:
        slots = self.calls[call].outputs if output else self.calls[call].inputs
        grads = self.check_backward and torch.is_grad_enabled()
        for path, t in tensors:
            seen = self._seen.get(id(t))  # read once while it stays the same object at the same version
            if seen is None or seen.version != t._version or seen.ref() is not t:
                seen = self._seen[id(t)] = _Seen(weakref.ref(t), t._version, self.readings.take(t))
            if seen.slot is not None:
                slots.append((path, seen.slot))
            if grads and t.requires_grad:
                self._watch(t, seen, call, path, output)

    def find(self, extra: Sequence[torch.Tensor] = ()) -> tuple[Finding | None, list[float]]:
        """Read everything (``extra`` 0-d tensors too, returned as floats) and find the first non-finite values.

        * forward: the first call, in the order calls *finish*, whose outputs hold a NaN while none of its
          inputs does, or an Inf while all its inputs are finite;
        * loss: non-finite values made after the model;
        * backward: the first gradient, in the order autograd computes them, non-finite at the input of a
          module whose output gradients were finite (by the same NaN-over-Inf rule);
        * otherwise, where non-finite values first *entered* the selected modules;
        * ``None`` when all was finite, or when the only non-finite values were inputs, or outputs' Inf that no loss
          or gradient got (``extra`` finite too): a mask.
        """
        readings, rest = self.readings.read(extra)
        bad = {slot for slot, r in enumerate(readings) if r.nonfinite}
        # The usual cases, decided without building anything: all finite; or only inputs are not, or outputs hold
        # Inf but no NaN while the losses and gradients are finite (a mask: invalid actions' logits set to -inf).
        if not bad or not (
            any(slot in bad for slot in self.losses)
            or any(slot in bad for _, slot in self.events)
            or any(readings[slot].severity == NAN for call in self.calls for _, slot in call.outputs)
            or not all(map(math.isfinite, rest))
        ):
            return None, rest
        return self._forward(readings) or self._loss(readings) or self._backward(readings), rest

    def _call_finding(self, phase: Phase, index: int, **kwargs: Any) -> Finding:
        call = self.calls[index]
        same = [i for i, c in enumerate(self.calls) if c.name == call.name]
        return Finding(
            phase, call.name, call.type, batch_idx=call.batch_idx, call=same.index(index) + 1, calls=len(same), **kwargs
        )

    def _forward(self, readings: list[Reading]) -> Finding | None:
        bad = [i for i in self.finished if _worst(self.calls[i].outputs, readings) != FINITE]
        made = [i for i in bad if _worst(self.calls[i].outputs, readings) > _worst(self.calls[i].inputs, readings)]
        if not bad:
            return None
        index = (made or bad)[0]
        made_or_bad = self.finished.index(index)
        call = self.calls[index]
        path, slot = max(call.outputs, key=lambda item: readings[item[1]].severity)
        given = tuple((p, readings[s]) for p, s in call.inputs)
        return self._call_finding(
            "forward", index, tensor=(path, readings[slot]), given=given, made_here=bool(made), position=made_or_bad
        )

    def _loss(self, readings: list[Reading]) -> Finding | None:
        return next((Finding("loss", tensor=("", readings[s])) for s in self.losses if readings[s].severity), None)

    def _backward(self, readings: list[Reading]) -> Finding | None:
        out_grads: dict[int, list[tuple[str, int]]] = {}
        for group, slot in self.events:
            for call, path, output in self.groups[group]:
                if output:
                    out_grads.setdefault(call, []).append((path, slot))
        out_worst = {call: _worst(grads, readings) for call, grads in out_grads.items()}
        events = [(i, group, slot) for i, (group, slot) in enumerate(self.events) if readings[slot].severity != FINITE]
        if not events:
            return None
        for position, group, slot in events:
            bad = readings[slot].severity
            makers = [(c, p) for c, p, output in self.groups[group] if not output and out_worst.get(c, FINITE) < bad]
            if makers:
                # A container and its first child share their input: name the innermost.
                names = [self.calls[c].name for c, _ in makers]
                inner = [
                    (c, p)
                    for (c, p), own in zip(makers, names, strict=True)
                    if not any(n != own and (not own or n.startswith(own + ".")) for n in names)
                ]
                (call, path), others = inner[0], [self.calls[c].name for c, _ in inner[1:]]
                given = tuple((p, readings[s]) for p, s in out_grads.get(call, []))
                return self._call_finding(
                    "backward",
                    call,
                    tensor=(path, readings[slot]),
                    given=given,
                    shared_with=tuple(others),
                    position=position,
                )
        _, group, slot = events[0]
        roles = self.groups[group]
        call, path, _ = next((r for r in roles if r[2]), roles[0])
        return self._call_finding("backward", call, tensor=(path, readings[slot]), made_here=False)


class _Enter:
    """Forward pre-hook: a call starts; measure its inputs before it can change them in place."""

    def __init__(self, recorder: NonFiniteRecorder, name: str, type_name: str) -> None:
        self.recorder, self.name, self.type_name = recorder, name, type_name

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        recorder = self.recorder
        if not recorder.active or in_backward() or in_transform():  # checkpointing re-running forward; vmap
            return
        index = len(recorder.calls)
        recorder.calls.append(_Call(self.name, self.type_name, recorder.batch_idx))
        recorder._open.setdefault(self.name, []).append(index)
        recorder._record(named_tensors(call_inputs(args, kwargs)), index, output=False)


class _Exit:
    """Forward hook: the call finished; measure its outputs."""

    def __init__(self, recorder: NonFiniteRecorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        recorder = self.recorder
        if not recorder.active or in_backward() or in_transform():
            return
        if not (open_calls := recorder._open.get(self.name)):
            return
        index = open_calls.pop()
        recorder.finished.append(index)
        recorder._record(named_tensors(output), index, output=True)


class _GradProbe:
    """Tensor hook: measure the gradient autograd computed for a watched tensor."""

    def __init__(self, recorder: NonFiniteRecorder, group: int, generation: int) -> None:
        self.recorder, self.group, self.generation = recorder, group, generation

    def __call__(self, grad: torch.Tensor) -> None:
        recorder = self.recorder
        if recorder.generation != self.generation:  # a graph kept from a step already read
            return
        if (slot := recorder.readings.take(grad)) is not None:
            recorder.events.append((self.group, slot))


def find_nonfinite(
    model: nn.Module,
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    selector: ModuleSelector | None = None,
    **kwargs: Any,
) -> Finding | None:
    """Run ``model(*args, **kwargs)`` (and backward through ``loss_fn(output)``) once; where did NaN/Inf appear?

    Without ``loss_fn`` only the forward pass is checked. No hook outlives the call.

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3, eps=0.0), nn.Linear(3, 1))
        >>> with torch.no_grad():  # every row becomes constant, and LayerNorm divides 0 by 0
        ...     _ = model[0].weight.zero_(), model[0].bias.zero_()
        >>> print(find_nonfinite(model, torch.ones(2, 3)))
        forward: `1` (LayerNorm) made non-finite values from finite inputs; output: 6 of 6 values are NaN
        inputs: input min 0, max 0
    """
    recorder = NonFiniteRecorder(check_backward=loss_fn is not None)
    recorder.active = True
    with HookHandles() as handles:
        recorder.attach((selector or ModuleSelector()).select(model), handles)
        output = model(*args, **kwargs)
        if loss_fn is not None:
            loss = loss_fn(output)
            recorder.record_loss(loss)
            loss.backward()
    recorder.active = False
    return recorder.find()[0]


def grad_readings(named: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Per gradient, its 2-norm as a 0-d tensor: not finite when the gradient is not, nor when the squares of
    finite values overflow (:func:`parameter_readings` tells them apart)."""
    grads = [g for _, g in named]
    return list(torch._foreach_norm(grads, 2)) if grads else []


def finite_step(
    grads: list[torch.Tensor], losses: Sequence[torch.Tensor] = (), flags: Sequence[torch.Tensor] = ()
) -> bool:
    """Whether a step is finite: every gradient, every loss, and no ``flag`` set (a ``GradScaler``'s ``found_inf``).

    The tensors must share a device. A sum that overflows for finite values makes a healthy step look bad.

    Example::

        >>> finite_step([torch.ones(3)], [torch.tensor(-0.5)])
        True
        >>> finite_step([torch.ones(3)], [torch.tensor(float("nan"))])
        False
        >>> finite_step([torch.ones(3)], flags=[torch.tensor([1.0])])
        False
    """
    tensors = [*grads, *(loss.detach() for loss in losses)]
    if not tensors and not flags:
        return True
    total = _finite_total(tensors) if tensors else None
    if flags:
        found = torch.stack([f.detach().float().sum() for f in flags]).sum()
        bad = torch.where(found > 0, math.inf, 0.0)
        total = bad if total is None else total + bad.to(total.device)
    return math.isfinite(total.item())  # type: ignore[union-attr]


def nonfinite_flag(grads: list[torch.Tensor], losses: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """1.0 where some gradient or loss holds NaN or Inf, else 0.0: a float32 0-d tensor left on their device (what
    a fused optimizer takes as ``found_inf``, to skip its step there without the host waiting).

    Example::

        >>> nonfinite_flag([torch.ones(3)], [torch.tensor(float("inf"))])
        tensor(1.)
    """
    total = _finite_total([*grads, *(loss.detach() for loss in losses)])
    return torch.isfinite(total).logical_not().float()


def _finite_total(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A number, NaN or infinite when some value of ``tensors`` is: the largest of their magnitudes on an accelerator
    (which no finite value overflows, whatever its dtype), the sum of their values on the CPU."""
    if tensors[0].device.type != "cpu":  # one fused kernel there; on a CPU, a loop over the tensors (slower than a sum)
        return torch.stack(torch._foreach_norm(tensors, math.inf)).amax()
    # The values end to end (one dtype after promotion), both parts of complex ones, summed in float32.
    real = (real_view(v) for v in flat_pieces(tensors))
    return torch.stack([v.sum(dtype=torch.float32) for v in real]).sum()


def parameter_readings(
    named: Sequence[tuple[str, torch.Tensor]], norms: Sequence[float]
) -> tuple[tuple[str, Reading], ...]:
    """The readings of the gradients that hold NaN or Inf, among those whose ``norms`` (from
    :func:`grad_readings`) are not finite."""
    out: list[tuple[str, Reading]] = []
    for (name, g), norm in zip(named, norms, strict=True):
        if not math.isfinite(norm):
            count = int(nonfinite_count(g))
            if count:  # not a finite gradient whose squares overflowed
                low, high = torch.aminmax(g.detach())
                out.append((name, Reading(low.item(), high.item(), g.numel(), count)))
    return tuple(out)

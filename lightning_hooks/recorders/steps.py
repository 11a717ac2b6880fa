"""What ``HealthMonitor`` keeps of each optimizer step between logging steps: the losses and gradient norms of a
ring of steps, whether ``.grad`` is zeroed between steps, and each parameter group's learning rate and weight decay."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_hooks.core.autograd import dense_gradient
from lightning_hooks.core.shards import local
from lightning_hooks.diagnose.moments import SPIKE_MIN_HISTORY, loss_level
from lightning_hooks.stats.batch import Fetched

__all__ = [
    "CARRY_MATCH",
    "CARRY_SAMPLE",
    "Carried",
    "LossRing",
    "Settings",
    "carried_layers",
    "learning_rate",
    "weight_decay",
]

CARRY_SAMPLE = 8
"""How many parameters, the smallest, tell whether ``.grad`` is zeroed between steps under manual optimization."""
CARRY_MATCH = 1e-3
"""The rounding allowed between a ``.grad`` never zeroed and the sum of what it held and what was added to it."""


class Carried:
    """Tensor hook on a parameter for one step under manual optimization, the previous batch having stepped the
    optimizer. The first gradient to come finds in ``.grad`` what it held at that step, unless it was zeroed since:
    it keeps its L1 norm and its signs, then sums every gradient's projection on those signs. :meth:`evidence` adds
    the projection of ``.grad`` at this step: equal to the two sums together when nothing zeroed ``.grad`` in between
    (a GAN's discriminator, whose ``.grad`` the generator's backward added to and which is then zeroed, is not)."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param
        self.signs: torch.Tensor | None = None
        self.old: torch.Tensor | None = None
        self.fresh: list[torch.Tensor] = []
        self.started = False

    def __call__(self, grad: torch.Tensor) -> None:
        if not self.started:
            self.started = True
            old = self.param.grad
            if old is not None and old.layout == torch.strided and not old.is_complex():
                self.signs, self.old = old.detach().sign(), old.detach().abs().sum()
        if self.signs is not None and grad.layout == torch.strided:
            self.fresh.append((grad.detach() * self.signs).sum())

    def evidence(self) -> torch.Tensor | None:
        """``[L1 of the old .grad, the gradients' projection, .grad's projection now]``, or None (nothing carried)."""
        grad = self.param.grad
        if self.signs is None or self.old is None or grad is None or grad.layout != torch.strided:
            return None
        fresh = torch.stack(self.fresh).sum() if self.fresh else torch.zeros_like(self.old)
        return torch.stack([self.old, fresh, (grad.detach() * self.signs).sum()]).float()


def learning_rate(group: dict[str, Any]) -> float:
    """A parameter group's learning rate; NaN where the optimizer sets its own (Adafactor's ``relative_step``
    leaves ``lr=None``)."""
    lr = group.get("lr")
    return math.nan if lr is None else float(lr)


def weight_decay(optimizer: torch.optim.Optimizer, group: dict[str, Any], lr: float) -> tuple[float, float] | None:
    """A parameter group's ``weight_decay`` and the share of every weight it removes each optimizer step: ``lr × wd``
    where the decay is decoupled from the gradient (AdamW, ``decoupled_weight_decay=True``, Lion), ``lr × wd ×
    (1 - dampening) / (1 - momentum)`` under SGD (the decay joins the gradient, which momentum sums), NaN under another
    optimizer (the decay joins a gradient that the optimizer's own statistics scale); None without a decay, or without
    a learning rate (Adafactor's relative step)."""
    wd = group.get("weight_decay")
    if not isinstance(wd, int | float) or not wd > 0 or math.isnan(lr):
        return None
    wd = float(wd)
    if isinstance(optimizer, torch.optim.SGD):
        momentum, dampening = float(group.get("momentum", 0.0)), float(group.get("dampening", 0.0))
        return wd, lr * wd * ((1 - dampening) / (1 - momentum) if 0 < momentum < 1 else 1.0)
    name = type(optimizer).__name__.lower()
    if group.get("decoupled_weight_decay") or "adamw" in name or "lion" in name:
        return wd, lr * wd
    return wd, math.nan


class LossRing:
    """The last ``size`` optimizer steps' losses and per-parameter gradient norms, kept on device until
    :meth:`hand_over`; on a CPU, where reading the loss costs nothing, the loss as a number, and a quiet step's norms
    only if its loss reaches ``halfway`` or is not finite. Before the
    monitor has a loss history to give ``halfway`` (at the first logging step with :data:`SPIKE_MIN_HISTORY` losses
    before it), the ring takes it from the losses it holds once they are as many, as the monitor would
    (``threshold``: its ``spike_threshold``)."""

    def __init__(self, params: list[torch.Tensor], size: int, device: torch.device, threshold: float) -> None:
        self.params, self.size, self.threshold = params, size, threshold
        self.zero = torch.zeros((), device=device)
        self.losses: dict[int, Any] = {}  # per step, its loss: a tensor, or on a CPU a float
        self.grad_norms: dict[int, torch.Tensor] = {}
        self.overflow: dict[int, torch.Tensor] = {}  # of the steps with norms, a GradScaler's flag where there is one
        self.halfway: float | None = None
        self._on_host = device.type == "cpu"
        self._loss_step = -1

    def loss(self, step: int, loss: torch.Tensor) -> None:
        # on a CPU, read from host memory (`tolist` waits for nothing and dispatches no operator); on an accelerator,
        # kept on the device until the logging step's one transfer
        value: Any = loss.tolist() if self._on_host else loss.detach()
        if isinstance(value, list):  # a loss of shape (1,)
            value = math.fsum(value)
        if step == self._loss_step:  # a further micro-batch of the step (Lightning divides each by their count)
            self.losses[step] = self.losses[step] + value
            return
        self.losses[step] = value
        self._loss_step = step
        if len(self.losses) > self.size:
            oldest = next(iter(self.losses))  # steps are kept in the order they came
            del self.losses[oldest]
            self.grad_norms.pop(oldest, None)
            self.overflow.pop(oldest, None)

    def norms(
        self, step: int, logging: bool, overflow: list[torch.Tensor] | None = None, taken: torch.Tensor | None = None
    ) -> None:
        """Keep the step's per-parameter gradient norms: ``taken`` where the logging step took them already."""
        if step in self.grad_norms:  # a further optimizer of the step
            return
        # On a CPU reading the loss costs nothing and torch's foreach norm loops over the tensors, so a quiet step
        # takes the norms only when its loss is half-way to a spike (measured: docs/performance.md, HealthMonitor);
        # on an accelerator deciding would wait for the device.
        if self._on_host and self.halfway is None and len(self.losses) > SPIKE_MIN_HISTORY:  # enough to judge by
            history = [x for kept, x in self.losses.items() if kept != step and math.isfinite(x)]
            if history:
                median, deviation = loss_level(history)
                self.halfway = median + deviation * self.threshold / 2
        quiet = self._on_host and not logging and self.halfway is not None and step in self.losses
        if quiet and self.losses[step] < self.halfway:  # NaN compares false
            return
        if taken is not None:
            self.grad_norms[step] = taken
        else:
            zero = self.zero
            grads = [zero if p.grad is None else local(p.grad) for p in self.params]
            try:
                norms = torch._foreach_norm(grads)
            except (NotImplementedError, RuntimeError):  # a sparse gradient
                norms = torch._foreach_norm([dense_gradient(g) for g in grads])
            self.grad_norms[step] = torch.stack(norms)
        if overflow:
            self.overflow[step] = overflow[0] if len(overflow) == 1 else torch.stack(overflow).sum()

    def hand_over(self, batch: Any) -> tuple[list[int], set[int]]:
        """The steps kept since the last hand-over and those of them with norms, whose values go into ``batch``."""
        steps = sorted(self.losses)
        with_norms = [s for s in steps if s in self.grad_norms]
        if steps:
            losses = [self.losses[s] for s in steps]
            kept = torch.tensor(losses, dtype=torch.float32) if self._on_host else torch.stack(losses).float()
            batch.add_vector(("ring", "loss"), kept)
        if with_norms:
            batch.add_vector(("ring", "norms"), torch.cat([self.grad_norms[s] for s in with_norms]))
        if self.overflow:
            batch.add_vector(("ring", "overflow"), torch.stack([self.overflow.get(s, self.zero) for s in with_norms]))
        self.losses, self.grad_norms, self.overflow = {}, {}, {}
        return steps, set(with_norms)

    def rows(
        self, fetched: Fetched, steps: list[int], with_norms: set[int]
    ) -> tuple[list[tuple[int, float]], list[list[float]]]:
        """Of the ``steps`` :meth:`hand_over` gave (``with_norms``: those with norms), each one's ``(step, loss)`` and
        its per-parameter gradient norms, empty where none were taken or where a GradScaler skipped the step: its
        gradients measure the loss scale, not the model."""
        losses: list[tuple[int, float]] = []
        norms: list[list[float]] = []
        if not steps:
            return losses, norms
        flat, norm_rows = fetched.vectors[("ring", "loss")], fetched.vectors.get(("ring", "norms"), [])
        overflowed = fetched.vectors.get(("ring", "overflow"), [])
        width, row = len(self.params), 0
        for i, step in enumerate(steps):
            losses.append((step, flat[i]))
            taken = step in with_norms and not (row < len(overflowed) and overflowed[row] > 0)
            norms.append(norm_rows[row * width : (row + 1) * width] if taken else [])
            row += step in with_norms
        return losses, norms


def carried_layers(fetched: Fetched, carried: dict[str, list[str]]) -> list[str]:
    """The layers of the optimizers (``carried``: per key of a ``("carried", <key>)`` vector, the layers it steps)
    each of whose followed parameters' ``.grad`` still held, when their next gradient came, what it held at the
    previous optimizer step, and still does at this one: nothing zeroed it (see :class:`Carried`)."""
    layers: list[str] = []
    for key, names in carried.items():
        values = fetched.vectors.get(("carried", key), [])
        rows = list(zip(values[0::3], values[1::3], values[2::3], strict=True))
        if rows and all(
            old > 0 and abs(now - old - fresh) <= CARRY_MATCH * (old + abs(fresh)) for old, fresh, now in rows
        ):
            layers += names
    return layers


@dataclass
class Settings:
    """Per layer, what its optimizers' parameter groups set at the optimizer steps of one logging step: the learning
    rate (the highest; NaN where the optimizer sets its own), the ``eps`` of an adaptive optimizer, and the weight
    decay (see :func:`weight_decay`); and, over the fit, the layers an optimizer other than SGD updates."""

    lrs: dict[str, float] = field(default_factory=dict)
    eps: dict[str, float] = field(default_factory=dict)
    decay: dict[str, tuple[float, float]] = field(default_factory=dict)
    adaptive: set[str] = field(default_factory=set)

    def start(self) -> None:
        """Forget the previous logging step's settings (not which layers are adaptive)."""
        self.lrs, self.eps, self.decay = {}, {}, {}

    def read(self, optimizer: torch.optim.Optimizer, layer_of: dict[int, str]) -> None:
        """Read ``optimizer``'s parameter groups for the layers of their parameters (``layer_of``: per parameter id)."""
        adaptive = not isinstance(optimizer, torch.optim.SGD)
        for group in optimizer.param_groups:
            lr, eps = learning_rate(group), group.get("eps")
            decay = weight_decay(optimizer, group, lr)
            for p in group["params"]:
                if (layer := layer_of.get(id(p))) is not None:
                    before = self.lrs.get(layer)
                    self.lrs[layer] = lr if before is None or math.isnan(lr) else max(before, lr)
                    if isinstance(eps, float):  # Adafactor's is a pair
                        self.eps[layer] = eps
                    if decay is not None and decay[0] > self.decay.get(layer, (0.0,))[0]:
                        self.decay[layer] = decay
                    if adaptive:
                        self.adaptive.add(layer)

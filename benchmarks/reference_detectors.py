"""Two published rule sets for training problems, as reference detectors for HealthMonitor's corpus.

* :class:`AutoTrainer`: the detection rules of AutoTrainer (Zhang, Zhai and Wang, "AUTOTRAINER: An
  Automatic DNN Training Problem Detection and Repair System", ICSE 2021).
* :class:`DeepDiagnosis`: the rules of DeepDiagnosis (Wardat, Cruz, Le and Rajan, "DeepDiagnosis:
  Automatically Diagnosing Faults and Recommending Actionable Fixes in Deep Learning Programs", ICSE 2022),
  which extends DeepLocalize (Wardat, Le and Rajan, ICSE 2021).

Both are plain Lightning callbacks that watch the model with their own torch hooks; they do not import
``lightning_hooks``. The code is ours, written from the papers and the thresholds their authors published
with them (AutoTrainer's default parameters, DeepDiagnosis' callback), for Keras; what had to change for
PyTorch is said below. Each check period (``every`` optimizer steps, standing in for the papers' epoch)
they gather, at one step of it: every leaf module's output (and the input of sigmoid and tanh modules),
every trainable parameter's gradient before the optimizer step and its value after it; the loss and the
accuracy (``"accuracy"`` in what ``training_step`` returns, when it returns one) of every step go into
that period's means. A "layer with weights" is a module owning a trainable parameter of two or more
dimensions (its kernel: linear, convolution, embedding, experts); layers are named as ``named_modules()``
of the LightningModule names them. Like the originals, each stops at its first diagnosis: the findings
are those of one check.

AutoTrainer (every rule over the whole model; a diagnosis only from 30 % of the run on):

=====================  ================================================================  ======================
its problem            rule (paper's parameter)                                           our check, layer
=====================  ================================================================  ======================
exploding (NaN)        NaN/Inf in the loss, a gradient or a weight; at once                ``nonfinite``
exploding (loss)       the loss of a period at or above 1e5; at once                       ``exploding_gradients``
dying ReLU             >= 70 % of all gradient elements exactly zero (gamma = 0.7)         ``dead_units``
exploding gradient     ``||g(first kernel)|| / ||g(last kernel)|| > 70`` (beta_3)          ``exploding_gradients``,
                                                                                           first kernel's layer
vanishing gradient     that ratio < 1e-3 (beta_1) and ``||g(first kernel)|| < 1e-4``       ``vanishing_gradients``,
                       (beta_2)                                                            first kernel's layer
slow convergence       no period's accuracy 0.01 (delta) above the previous one            ``no_learning``
oscillating loss       accuracy peaks and troughs 0.03 (zeta) apart at >= 20 % (eta) of     ``loss_spike``
                       the periods, with the model converging
=====================  ================================================================  ======================

The gradient rules count at every check; from 30 % of the checks on, a run whose best accuracy is below 0.7
(Theta) or that converges slowly is diagnosed with dying ReLU, else exploding, else vanishing gradients, else
slow convergence; a run that converges is diagnosed with an oscillating loss. A run without accuracy
(a regression) counts as not converged and is never judged slow or oscillating.

DeepDiagnosis (in this order at each check; ``N = 5`` checks for the "unchanged" rules, 20 for accuracy):

==========================  ===========================================================  ==================
its symptom                 rule                                                         our check, layer
==========================  ===========================================================  ==================
out of range (first check)  regression targets outside the last layer's output range    ``input_scale``,
                            (sigmoid [0, 1], tanh [-1, 1]), or a linear last layer whose  last layer
                            outputs spread 10 times wider than the targets
exploding tensor            a layer's output mean NaN/Inf                                ``nonfinite``, it
numerical error (zero)      a layer's output mean exactly 0                              ``dead_units``, it
dead node                   >= 70 % of a ReLU's outputs <= 0                              ``dead_units``, it
saturated activation        > 50 % of a sigmoid's or tanh's inputs beyond +-5 (every N)  ``saturation``, it
unchanged forward           a layer's output mean equal over N checks (outputs that      ``no_learning``, it
                            depend on trainable weights)
invalid loss                the loss NaN/Inf                                             ``nonfinite``
loss not decreasing         the loss equal over N checks                                 ``no_learning``
invalid accuracy            an accuracy of exactly 0                                     ``no_learning``
accuracy not increasing     the accuracy equal over 20 checks                            ``no_learning``
numerical error (gradient)  a layer's gradient mean NaN/Inf (from the output back)       ``nonfinite``, it
zero gradient               a layer's gradient mean exactly 0 (or no gradient)           ``no_learning``, it
vanishing gradient          a layer's mean ``|gradient|`` below 1e-7                     ``vanishing_gradients``,
                                                                                         it
numerical error (weight)    a layer's weight mean NaN/Inf, or exactly 0                  ``nonfinite`` /
                                                                                         ``no_learning``, it
unchanged weight            a layer's weight mean, or gradient mean, equal over N checks ``no_learning``, it
==========================  ===========================================================  ==================

Where the PyTorch port differs: a Keras ``Dense(activation=...)`` is one layer, a PyTorch activation is a
module of its own, so the dead-node and saturation rules name the activation module (whose input or output
they read); the out-of-range rule's branch for classification (a last layer that is not a softmax under a
cross-entropy loss) is left out, since PyTorch's ``cross_entropy`` takes logits, and it needs the regression
targets (``targets``); the "unchanged forward" rule reads the training batch of the check, not a fixed
batch, and only outputs in the autograd graph (a Keras layer of a model in training is in it; a rotary
position table, computed without gradient, is the same at every step by design); dead nodes are judged at
every check, not only at the last epoch. An epoch of the papers is a check period here; AutoTrainer checks at
the end of each (its accuracy history, which its oscillation and convergence tests read, is one mean per
epoch, and needs periods long enough that a batch's noise does not pass for an oscillation:
``benchmarks/health.py`` gives it 10 steps), DeepDiagnosis at the start of each, as HealthMonitor does.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["AutoTrainer", "DeepDiagnosis", "ReferenceFinding"]

Targets = Callable[[Any], torch.Tensor | None]


@dataclass(frozen=True)
class ReferenceFinding:
    """A diagnosis: the paper's name for it (``rule``), the HealthMonitor check it maps to, the layer it
    names (``None``: the whole model) and the optimizer step of the check that made it."""

    rule: str
    check: str
    layer: str | None
    step: int


@dataclass
class LayerOutput:
    """One leaf module's output at a check (numbers only)."""

    kind: str
    """``relu``, ``sigmoid``, ``tanh``, ``flatten`` or ``other``."""
    mean: float
    finite: bool
    nonpositive: float
    """Share of outputs <= 0."""
    low: float
    high: float
    saturated: float = 0.0
    """Share of the inputs beyond +-5 (sigmoid and tanh)."""
    trained: bool = True
    """Whether the output is in the autograd graph (it depends on trainable weights)."""


@dataclass
class Kernel:
    """A layer's kernel at a check: its gradient before the optimizer step, its value after."""

    grad_mean: float = 0.0
    grad_abs_mean: float = 0.0
    grad_norm: float = 0.0
    grad_finite: bool = True
    weight_mean: float = 0.0
    weight_finite: bool = True


def first_float_tensor(value: Any) -> torch.Tensor | None:
    """The first floating-point tensor in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple | list) else ()
    return next((t for t in map(first_float_tensor, items) if t is not None), None)


def kind_of(module: nn.Module) -> str:
    if isinstance(module, nn.ReLU | nn.ReLU6):
        return "relu"
    if isinstance(module, nn.Sigmoid):
        return "sigmoid"
    if isinstance(module, nn.Tanh):
        return "tanh"
    return "flatten" if isinstance(module, nn.Flatten) else "other"


class OutputProbe:
    """A forward hook that writes a :class:`LayerOutput` of ``name`` into ``seen`` while ``gate`` is open."""

    def __init__(self, name: str, kind: str, seen: dict[str, LayerOutput], gate: Gate) -> None:
        self.name, self.kind, self.seen, self.gate = name, kind, seen, gate

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        out = first_float_tensor(output)
        if not self.gate.open or not module.training or out is None or out.numel() == 0:
            return
        values = out.detach().float()
        finite = bool(torch.isfinite(values).all())
        saturated = 0.0
        if self.kind in ("sigmoid", "tanh") and (given := first_float_tensor(args)) is not None:
            saturated = float((given.detach().float().abs() >= 5.0).float().mean())
        self.seen.pop(self.name, None)  # a module called twice: its last call, in the order of the calls
        self.seen[self.name] = LayerOutput(
            kind=self.kind,
            mean=float(values.mean()),
            finite=finite,
            nonpositive=float((values <= 0).float().mean()),
            low=float(values.min()) if finite else math.nan,
            high=float(values.max()) if finite else math.nan,
            saturated=saturated,
            trained=out.requires_grad,
        )


@dataclass
class Gate:
    open: bool = False


@dataclass
class Period:
    """The losses and accuracies of the steps since the last check."""

    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)

    def loss(self) -> float:
        return statistics.fmean(self.losses) if self.losses else math.nan

    def accuracy(self) -> float | None:
        return statistics.fmean(self.accuracies) if self.accuracies else None


class ReferenceDetector(pl.Callback):
    """What both rule sets watch (see the module's docstring); a subclass implements :meth:`diagnose`.

    Args:
        every: Check period in optimizer steps (the papers' epoch).
        targets: The regression targets of a batch (``None`` for other batches), for DeepDiagnosis'
            out-of-range rule.
    """

    def __init__(self, every: int = 1, targets: Targets | None = None) -> None:
        if every < 1:
            raise ValueError(
                f"`{type(self).__name__}` got `every={every!r}`; `every` must be a positive number of steps."
            )
        self.every, self.targets = every, targets
        self.findings: list[ReferenceFinding] = []
        self.done = False
        self.checks = 0
        self.gate = Gate()
        self.outputs: dict[str, LayerOutput] = {}
        self.kernels: dict[str, Kernel] = {}
        self.zero_share = 0.0
        self.period = Period()
        self.history: list[tuple[float, float | None]] = []
        """Each check's period loss and accuracy."""
        self.target_range: tuple[float, float] | None = None
        self._handles: list[RemovableHandle] = []
        self._owners: list[tuple[str, nn.Parameter]] = []
        self._params: list[nn.Parameter] = []
        self._total_checks = 1
        self._step = 0

    AT_PERIOD_END = False
    """Check at the last step of each period (an epoch's end) instead of its first."""

    def diagnose(self, step: int) -> list[ReferenceFinding]:
        raise NotImplementedError

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0 if self.AT_PERIOD_END else step % self.every == 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.findings, self.done, self.checks, self.history = [], False, 0, []
        self._total_checks = max(1, sum(self.due(step) for step in range(max(trainer.max_steps, 1))))
        seen: set[int] = set()
        self._owners = []
        for name, module in pl_module.named_modules():
            if next(module.children(), None) is None:
                probe = OutputProbe(name, kind_of(module), self.outputs, self.gate)
                self._handles.append(module.register_forward_hook(probe))
            kernel = next((p for p in module.parameters(recurse=False) if p.requires_grad and p.dim() >= 2), None)
            if kernel is not None and id(kernel) not in seen:
                seen.add(id(kernel))
                self._owners.append((name, kernel))
        self._params = [p for p in pl_module.parameters() if p.requires_grad]

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.gate.open = not self.done and self.due(trainer.global_step)
        if self.gate.open:
            self._step = trainer.global_step
            self.outputs.clear()
            self.kernels = {}
            if self.targets is not None and self.checks == 0 and (y := self.targets(batch)) is not None:
                self.target_range = (float(y.min()), float(y.max()))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.gate.open:
            return
        zeros, total = 0, 0
        for p in self._params:
            total += p.numel()
            zeros += p.numel() if p.grad is None else int((p.grad == 0).sum())
        self.zero_share = zeros / max(total, 1)
        for name, kernel in self._owners:
            g = torch.zeros_like(kernel) if kernel.grad is None else kernel.grad.detach().float()
            self.kernels[name] = Kernel(
                grad_mean=float(g.mean()),
                grad_abs_mean=float(g.abs().mean()),
                grad_norm=float(torch.linalg.vector_norm(g)),
                grad_finite=bool(torch.isfinite(g).all()),
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.done:
            return
        if isinstance(outputs, dict) and "loss" in outputs:
            self.period.losses.append(float(outputs["loss"]))
            if "accuracy" in outputs:
                self.period.accuracies.append(float(outputs["accuracy"]))
        elif isinstance(outputs, torch.Tensor):
            self.period.losses.append(float(outputs))
        if not self.gate.open:
            return
        self.gate.open = False
        for name, kernel in self._owners:
            if name in self.kernels:
                weight = kernel.detach().float()
                self.kernels[name].weight_mean = float(weight.mean())
                self.kernels[name].weight_finite = bool(torch.isfinite(weight).all())
        self.checks += 1
        self.history.append((self.period.loss(), self.period.accuracy()))
        self.period = Period()
        found = self.diagnose(self._step)
        if found:
            self.findings, self.done = found, True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.outputs.clear()

    def kernels_in_order(self) -> Iterator[tuple[str, Kernel]]:
        return ((name, self.kernels[name]) for name, _ in self._owners if name in self.kernels)


class AutoTrainer(ReferenceDetector):
    """AutoTrainer's detection rules (see the module's docstring for the rules and their mapping).

    Example::

        >>> AutoTrainer(every=2).findings
        []
    """

    AT_PERIOD_END = True
    BETA_1, BETA_2, BETA_3, GAMMA = 1e-3, 1e-4, 70.0, 0.7
    ZETA, ETA, DELTA, THETA = 0.03, 0.2, 0.01, 0.7
    JUDGMENT_POINT = 0.3
    LOSS_EXPLODED = 1e5

    def __init__(self, every: int = 1, targets: Targets | None = None) -> None:
        super().__init__(every, targets)
        self.counts = {"dying": 0, "exploding": 0, "vanishing": 0}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self.counts = {"dying": 0, "exploding": 0, "vanishing": 0}

    def diagnose(self, step: int) -> list[ReferenceFinding]:
        loss, _ = self.history[-1]
        kernels = list(self.kernels_in_order())
        broken = not math.isfinite(loss) or any(not k.grad_finite or not k.weight_finite for _, k in kernels)
        if broken:
            return [ReferenceFinding("exploding (NaN)", "nonfinite", None, step)]
        if loss >= self.LOSS_EXPLODED:
            return [ReferenceFinding("exploding (loss)", "exploding_gradients", None, step)]
        first = kernels[0] if kernels else None
        if first is not None:
            ratio = first[1].grad_norm / max(kernels[-1][1].grad_norm, 1e-30)
            self.counts["vanishing"] += ratio < self.BETA_1 and first[1].grad_norm < self.BETA_2
            self.counts["exploding"] += ratio > self.BETA_3
        self.counts["dying"] += self.zero_share >= self.GAMMA
        if self.checks < self.JUDGMENT_POINT * self._total_checks:
            return []
        accuracies = [a for _, a in self.history if a is not None]
        not_converged = not accuracies or max(accuracies) < self.THETA
        gains = [b - a for a, b in zip(accuracies, accuracies[1:], strict=False)]
        slow = bool(accuracies) and max(gains, default=0.0) < self.DELTA
        first_layer = first[0] if first is not None else None
        if not_converged or slow:
            if self.counts["dying"]:
                return [ReferenceFinding("dying ReLU", "dead_units", None, step)]
            if self.counts["exploding"]:
                return [ReferenceFinding("exploding gradient", "exploding_gradients", first_layer, step)]
            if self.counts["vanishing"]:
                return [ReferenceFinding("vanishing gradient", "vanishing_gradients", first_layer, step)]
            if slow:
                return [ReferenceFinding("slow convergence", "no_learning", None, step)]
            return []
        if oscillating(accuracies, self.ZETA, self.ETA):
            return [ReferenceFinding("oscillating loss", "loss_spike", None, step)]
        return []


def oscillating(values: list[float], amplitude: float, rate: float) -> bool:
    """AutoTrainer's oscillation test: the i-th local peak and i-th local trough of ``values`` at least
    ``amplitude`` apart for at least ``rate`` of the values' count."""
    inner = range(1, len(values) - 1)
    peaks = [values[i] for i in inner if values[i] >= values[i - 1] and values[i] >= values[i + 1]]
    troughs = [values[i] for i in inner if values[i] <= values[i - 1] and values[i] <= values[i + 1]]
    count = sum(1 for p, t in zip(peaks, troughs, strict=False) if p - t >= amplitude)
    return count >= rate * len(values)


class DeepDiagnosis(ReferenceDetector):
    """DeepDiagnosis' rules (see the module's docstring for the rules and their mapping).

    Example::

        >>> DeepDiagnosis(every=2).findings
        []
    """

    N, ACCURACY_N = 5, 20
    DEAD, SATURATED, SATURATION_LIMIT = 0.7, 0.5, 5.0
    VANISHING = 1e-7
    WIDER = 10.0

    def __init__(self, every: int = 1, targets: Targets | None = None) -> None:
        super().__init__(every, targets)
        self.means: dict[str, list[float]] = {}
        """Per layer, the output mean of each check; per ``grad:``/``weight:`` layer, its gradient / weight mean."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self.means = {}

    def diagnose(self, step: int) -> list[ReferenceFinding]:
        found = self._forward(step) or self._metrics(step) or self._backward(step)
        return found[:1]

    def _unchanged(self, key: str, value: float, window: int) -> bool:
        """Record ``value`` under ``key``; whether the last ``window`` values are all equal, at every
        ``window``-th check."""
        values = self.means.setdefault(key, [])
        values.append(value)
        return self.checks % window == 0 and len(values) >= window and len(set(values[-window:])) == 1

    def _forward(self, step: int) -> list[ReferenceFinding]:
        found: list[ReferenceFinding] = []
        layers = list(self.outputs.items())
        if self.checks == 1 and self.target_range is not None and layers:
            name, last = layers[-1]
            if out_of_range(last, self.target_range, self.WIDER):
                found.append(ReferenceFinding("out of range", "input_scale", name, step))
        every_n = self.checks % self.N == 0
        for name, out in layers:
            if not math.isfinite(out.mean):
                found.append(ReferenceFinding("exploding tensor", "nonfinite", name, step))
            elif out.mean == 0.0:
                found.append(ReferenceFinding("numerical error (zero)", "dead_units", name, step))
            elif out.kind == "relu" and out.nonpositive >= self.DEAD:
                found.append(ReferenceFinding("dead node", "dead_units", name, step))
            elif every_n and out.kind in ("sigmoid", "tanh") and out.saturated > self.SATURATED:
                found.append(ReferenceFinding("saturated activation", "saturation", name, step))
        for name, out in layers:
            if out.kind != "flatten" and out.trained and self._unchanged(name, out.mean, self.N) and not found:
                found.append(ReferenceFinding("unchanged forward", "no_learning", name, step))
        return found

    def _metrics(self, step: int) -> list[ReferenceFinding]:
        loss, accuracy = self.history[-1]
        if not math.isfinite(loss):
            return [ReferenceFinding("invalid loss", "nonfinite", None, step)]
        if self._unchanged("loss", loss, self.N):
            return [ReferenceFinding("loss not decreasing", "no_learning", None, step)]
        if accuracy is not None and accuracy == 0.0:
            return [ReferenceFinding("invalid accuracy", "no_learning", None, step)]
        if accuracy is not None and self._unchanged("accuracy", accuracy, self.ACCURACY_N):
            return [ReferenceFinding("accuracy not increasing", "no_learning", None, step)]
        return []

    def _backward(self, step: int) -> list[ReferenceFinding]:
        kernels = list(self.kernels_in_order())
        for name, k in reversed(kernels):
            if not math.isfinite(k.grad_mean):
                return [ReferenceFinding("numerical error (gradient)", "nonfinite", name, step)]
            if k.grad_mean == 0.0:
                return [ReferenceFinding("zero gradient", "no_learning", name, step)]
            if k.grad_abs_mean < self.VANISHING:
                return [ReferenceFinding("vanishing gradient", "vanishing_gradients", name, step)]
        for name, k in reversed(kernels):
            if not math.isfinite(k.weight_mean):
                return [ReferenceFinding("numerical error (weight)", "nonfinite", name, step)]
            if k.weight_mean == 0.0:
                return [ReferenceFinding("numerical error (weight)", "no_learning", name, step)]
        found = []
        for name, k in reversed(kernels):
            gradient_same = self._unchanged(f"grad:{name}", k.grad_mean, self.N)
            weight_same = self._unchanged(f"weight:{name}", k.weight_mean, self.N)
            if gradient_same or weight_same:
                found.append(ReferenceFinding("unchanged weight", "no_learning", name, step))
        return found


def out_of_range(last: LayerOutput, targets: tuple[float, float], wider: float) -> bool:
    """DeepDiagnosis' out-of-range test of the last layer against the regression targets' range."""
    low, high = targets
    if last.kind == "sigmoid":
        return low < 0.0 or high > 1.0
    if last.kind == "tanh":
        return low < -1.0 or high > 1.0
    if last.kind == "relu":
        return low < 0.0
    return abs(last.high - last.low) > abs(high - low) * wider

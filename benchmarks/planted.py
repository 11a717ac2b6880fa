"""Small models with one planted pathology each, on synthetic data: the fixtures of HealthMonitor's callback
tests (``tests/callbacks/test_health_monitor.py`` reads them as ``benchmarks.health``, which re-exports them).

The corpus HealthMonitor is measured on is ``benchmarks/health_cases.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["Planted", "dead_relu", "deep_linear", "fast_layer", "hot_layer", "mlp", "planted_model", "sigmoid_mlp"]


class Planted(pl.LightningModule):
    """``net`` on synthetic data: 4-class classification of Gaussian inputs, or regression with ``regression``.

    ``fast`` names a layer whose parameters get ``fast_factor`` times the learning rate; ``at_step``
    maps steps to a function applied to ``tap``'s output from that step on (``once`` keeps it to that step).
    """

    def __init__(
        self,
        net: nn.Sequential,
        optimizer: str = "sgd",
        lr: float = 0.05,
        regression: bool = False,
        fast: str | None = None,
        fast_factor: float = 100.0,
        tap: str | None = None,
        at_step: int | None = None,
        once: bool = True,
        effect: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.net, self.optimizer_name, self.lr, self.regression = net, optimizer, lr, regression
        self.fast, self.fast_factor = fast, fast_factor
        self.tap, self.at_step, self.once, self.effect = tap, at_step, once, effect
        generator = torch.Generator().manual_seed(0)
        width = net[0].in_features
        self.x = torch.randn(4096, width, generator=generator)
        teacher = torch.randn(width, 4, generator=generator)
        self.y = self.x @ teacher if regression else (self.x @ teacher).argmax(1)
        if tap is not None:
            dict(self.net.named_modules())[tap].register_forward_hook(self._perturb)

    def _perturb(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        step = self.trainer.global_step if self._trainer is not None else -1
        due = self.at_step is not None and (step == self.at_step if self.once else step >= self.at_step)
        if due and self.training and self.effect is not None:
            return self.effect(output)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return F.mse_loss(out, y) if self.regression else F.cross_entropy(out, y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=64, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        fast = [p for n, p in self.named_parameters() if self.fast and n.startswith(f"net.{self.fast}.")]
        slow = [p for p in self.parameters() if all(p is not q for q in fast)]
        groups = [{"params": slow}] + ([{"params": fast, "lr": self.lr * self.fast_factor}] if fast else [])
        cls = torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.SGD
        return cls(groups, lr=self.lr)


def dead_relu() -> Planted:
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    with torch.no_grad():
        net[0].bias.fill_(-10.0)
    return Planted(net)


def sigmoid_mlp() -> Planted:
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.Sigmoid()]
    for _ in range(19):
        layers += [nn.Linear(32, 32), nn.Sigmoid()]
    return Planted(nn.Sequential(*layers, nn.Linear(32, 4)), lr=0.1)


def deep_linear() -> Planted:
    net = nn.Sequential(nn.Linear(16, 16, bias=False), *(nn.Linear(16, 16, bias=False) for _ in range(11)))
    for layer in net:
        nn.init.orthogonal_(layer.weight, gain=1.6)
    return Planted(nn.Sequential(*net, nn.Linear(16, 4, bias=False)), lr=8e-5, regression=True)


def hot_layer() -> Planted:
    net = mlp()
    with torch.no_grad():
        net[2].weight.mul_(1e4)
    return Planted(net, lr=1e-7)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def fast_layer() -> Planted:
    return Planted(mlp(), lr=0.05, fast="2")


def times_1e3(out: torch.Tensor) -> torch.Tensor:
    return out * 1e3


def poison(out: torch.Tensor) -> torch.Tensor:
    out = out.clone()
    out[0, 0] = float("nan")
    return out


def planted_model(kind: str, at_step: int, once: bool | None = None) -> Planted:
    """The MLP with ``net.2``'s output multiplied by 1e3 (``"spike"``, at ``at_step`` only) or holding a NaN
    (``"nan"``, from ``at_step`` on)."""
    if kind == "spike":
        return Planted(mlp(), tap="2", at_step=at_step, once=True if once is None else once, effect=times_1e3)
    return Planted(mlp(), tap="2", at_step=at_step, once=False if once is None else once, effect=poison)

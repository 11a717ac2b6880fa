"""HealthMonitor's calibration: planted pathologies it must find in the right layer, healthy runs it must leave alone.

    .venv/bin/python benchmarks/health.py            # every case, about 3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/health.py --quick    # fewer steps on the healthy runs (a smoke run)

Planted (each a small model on synthetic data, ``HealthMonitor(log_every_n_steps=10)`` with its defaults):

* ``dead ReLU``: a ReLU after a linear layer whose bias starts at -10 (every unit dead) → ``dead_units`` in that ReLU.
* ``sigmoid x20``: a 20-layer sigmoid MLP under SGD → ``vanishing_gradients`` in its first layer.
* ``deep linear, gain 1.6``: 12 linear layers, orthogonal initialisation with gain 1.6, SGD on a regression
  → ``exploding_gradients`` (the total norm grows without bound; every layer grows alike).
* ``lr x100 in one layer``: SGD at 0.05, one layer's parameter group at 5.0 → ``update_ratio`` in that layer.
* ``one layer's weights x1e4``: a linear layer's weights multiplied by 1e4 at the start → ``activation_growth``
  in that layer.
* ``digits CNN, Adam lr x100``: the digits example at ``lr=1.0`` → any finding (Adam's steps are bounded by
  the learning rate, so as the weights blow up their update ratio falls: other checks see it).
* ``x1e3 at one step``: at step 95 (a quiet step) one layer's output is multiplied by 1e3 → ``loss_spike``
  naming that layer.
* ``NaN injection``: from step 40 one layer's output holds a NaN → ``nonfinite`` naming that layer.

Healthy: every example model (digits CNN, NumNet, ResNet, transformer) with its own data and learning rate.
A run is *detected* when the expected check made a finding whose worst layer is the planted one; a
*false alarm* is any finding on a healthy run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.digits import DigitsCNN, DigitsDataModule  # noqa: E402
from examples.numnet import NumDataModule, NumNet  # noqa: E402
from examples.resnet import DigitsResNet  # noqa: E402
from examples.transformer import TinyTransformerLM, TokenDataModule  # noqa: E402
from lightning_hooks import HealthFinding, HealthMonitor  # noqa: E402

CHECKS = tuple(HealthMonitor().checks)
"""Every check, in ``HealthMonitor``'s order (``checks=None`` runs all of them)."""

EVERY = 10


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


@dataclass
class Case:
    name: str
    build: Callable[[], tuple[pl.LightningModule, pl.LightningDataModule | None]]
    steps: int
    check: str | None = None
    """The check that must find it (``None``: a healthy run, which must find nothing)."""
    layer: str | None = None
    """The layer it must name first (``None``: any)."""


def planted(steps: int) -> list[Case]:
    return [
        Case("dead ReLU", lambda: (dead_relu(), None), 60, "dead_units", "net.1"),
        Case("sigmoid x20", lambda: (sigmoid_mlp(), None), 60, "vanishing_gradients", "net.0"),
        Case("deep linear, gain 1.6", lambda: (deep_linear(), None), 100, "exploding_gradients"),
        Case("lr x100 in one layer", lambda: (fast_layer(), None), 60, "update_ratio", "net.2"),
        Case("digits CNN, Adam lr x100", lambda: (DigitsCNN(lr=1.0), DigitsDataModule()), 100, "any"),
        Case("one layer's weights x1e4", lambda: (hot_layer(), None), 60, "activation_growth", "net.2"),
        Case("x1e3 at one step", lambda: (planted_model("spike", 95), None), 110, "loss_spike", "net.2"),
        Case("NaN injection", lambda: (planted_model("nan", 40), None), 60, "nonfinite", "net.2"),
    ]


def healthy(steps: int) -> list[Case]:
    return [
        Case("digits CNN", lambda: (DigitsCNN(), DigitsDataModule()), steps),
        Case("NumNet", lambda: (NumNet(), NumDataModule()), steps),
        Case("ResNet", lambda: (DigitsResNet(), DigitsDataModule()), steps),
        Case("transformer", lambda: (TinyTransformerLM(), TokenDataModule()), steps),
    ]


def run(case: Case, root: str) -> list[HealthFinding]:
    pl.seed_everything(0, verbose=False)
    model, data = case.build()
    monitor = HealthMonitor(log_every_n_steps=EVERY)
    trainer = pl.Trainer(
        max_steps=case.steps,
        callbacks=[monitor],
        logger=TensorBoardLogger(root, name=case.name.replace(" ", "_")),
        log_every_n_steps=EVERY,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    return monitor.findings


def detected(case: Case, findings: list[HealthFinding]) -> bool:
    mine = [f for f in findings if f.check == case.check or case.check == "any"]
    if not mine:
        return False
    if case.layer is None:
        return True
    worst = min(mine, key=lambda f: f.value) if case.check == "vanishing_gradients" else mine[0]
    return worst.layers[0] == case.layer


def describe(findings: list[HealthFinding], shown: int = 4) -> str:
    """The first ``shown`` findings as ``check layers @step``, and how many more."""
    said = [f"{f.check} {', '.join(f.layers)} @{f.step}" for f in findings[:shown]]
    more = f" (+{len(findings) - shown} more: {', '.join(sorted({f.check for f in findings[shown:]}))})"
    return "; ".join(said) + (more if len(findings) > shown else "") or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps of each healthy run")
    parser.add_argument("--quick", action="store_true", help="healthy runs of 30 steps (a smoke run)")
    parser.add_argument("--only", nargs="*", metavar="RUN", help="run only these runs (names as in the table)")
    args = parser.parse_args()
    steps = 30 if args.quick else args.steps
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cases = [c for c in planted(steps) + healthy(steps) if not args.only or c.name in args.only]
    results: list[tuple[Case, list[HealthFinding], float]] = []
    with tempfile.TemporaryDirectory() as root:
        for case in cases:
            started = time.monotonic()
            results.append((case, run(case, root), time.monotonic() - started))
    print(f"HealthMonitor(log_every_n_steps={EVERY}) with its default thresholds, torch {torch.__version__}\n")
    print("| run | steps | expected | detected in the right layer | findings (check, layers, first step) |")
    print("|---|---:|---|---|---|")
    for case, findings, _ in results:
        expected = f"{case.check} in `{case.layer}`" if case.layer else (case.check or "nothing")
        verdict = ("yes" if detected(case, findings) else "NO") if case.check else ("yes" if not findings else "NO")
        print(f"| {case.name} | {case.steps} | {expected} | {verdict} | {describe(findings)} |")
    print("\n| check | planted cases detected | false alarms on healthy runs |")
    print("|---|---:|---:|")
    for check in CHECKS:
        mine = [(c, f) for c, f, _ in results if c.check == check]
        hits = sum(detected(c, f) for c, f in mine)
        alarms = sum(1 for c, f, _ in results if c.check is None for x in f if x.check == check)
        print(f"| `{check}` | {hits} of {len(mine)} | {alarms} |")


if __name__ == "__main__":
    main()

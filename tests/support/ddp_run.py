"""A real 2-process DDP fit on CPU (gloo), run by tests/integration/test_ddp.py as a script.

    python tests/support/ddp_run.py --strategy ddp|ddp_spawn --out DIR [--uneven | --health [--functional]]

Lightning's `ddp` launcher re-executes this script for rank 1 and `ddp_spawn` pickles the
callbacks into spawned processes: both need a script, not a pytest process.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hooks import ActivationStats, GradClamp, GradStats, HealthMonitor, ShapeLogger  # noqa: E402
from tests.support.helpers import EndingDDP, TinyNet, end_script  # noqa: E402


class UnevenNet(TinyNet):
    """Rank 1 gets batches of 6 rows, rank 0 of 8: shapes differ between ranks."""

    def train_dataloader(self) -> DataLoader:
        size = 6 if self.trainer.global_rank == 1 else 8
        return DataLoader(TensorDataset(self.x, self.y), batch_size=size)


class HalfDeadOnEachRank(TinyNet):
    """``fc1`` copies ``x`` and ``-x``; rank 0's inputs are negative and rank 1's positive, so each rank alone
    sees half of the ReLU ``act``'s units dead for its whole batch, and the two ranks together see none."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.cat([torch.eye(4), -torch.eye(4)]))
            self.fc1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.act(self.fc1(x))))

    def train_dataloader(self) -> DataLoader:
        sign = -1.0 if self.trainer.global_rank == 0 else 1.0
        return DataLoader(TensorDataset(sign * self.x.abs(), self.y), batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the units stay where they are


class HalfDeadFunctional(HalfDeadOnEachRank):
    """The same with the ReLU applied in forward (``F.relu``): its units are counted where ``fc2`` takes them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(torch.relu(self.fc1(x))))


class PickleCheck(pl.Callback):
    """Pickles every callback in the middle of fit, hooks attached; saves each rank's batches."""

    def __init__(self, out: Path) -> None:
        self.out, self.ok_during_fit = out, False
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self.batches.append((batch[0].clone(), batch[1].clone()))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        pickle.dumps([cb for cb in trainer.callbacks if cb is not self])
        self.ok_during_fit = True
        torch.save(self.batches, self.out / f"batches_rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--health", action="store_true", help="HealthMonitor alone, on HalfDeadOnEachRank")
    parser.add_argument("--functional", action="store_true", help="with --health: on HalfDeadFunctional")
    args = parser.parse_args()
    out = Path(args.out)
    torch.manual_seed(0)
    health = HalfDeadFunctional if args.functional else HalfDeadOnEachRank
    model = (health if args.health else UnevenNet if args.uneven else TinyNet)(batch_size=8)
    torch.save(model.state_dict(), out / "initial.pt")
    check = PickleCheck(out)
    callbacks: list[pl.Callback] = (
        [HealthMonitor(log_every_n_steps=1, checks=["dead_units"], exclude=["unused"], dead_fraction=0.5)]
        if args.health
        else [ShapeLogger(), GradClamp(0.05), GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)]
    )
    pickle.dumps(callbacks)
    # TinyNet has a layer that never runs.
    strategy: str | DDPStrategy = (
        EndingDDP(start_method="spawn", find_unused_parameters=True)
        if args.strategy == "ddp_spawn"
        else f"{args.strategy}_find_unused_parameters_true"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=64 if args.health else 2,  # health: a window of 512 samples per unit on one rank alone
        logger=TensorBoardLogger(out, name="tb", version=0),
        callbacks=[*callbacks, check],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=not (args.uneven or args.health),
    )
    trainer.fit(model)
    pickle.dumps(callbacks)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out / "final.pt")
        # With ddp_spawn, this process never ran the fit itself: its PickleCheck stays False.
        (out / "result.json").write_text(json.dumps({"pickled_during_fit": check.ok_during_fit}))


if __name__ == "__main__":
    main()
    end_script()

"""A real 2-process fit with MemoryLogger on CPU (gloo), run by tests/integration/test_memory_distributed.py.

    python tests/support/memory_run.py --strategy ddp|fsdp --out DIR

Rank 1's batches are twice as large as rank 0's, so its peak is the larger. Each rank writes its
``MemoryLogger``'s peak, summary and whether any hook was left to ``DIR/rank<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hooks import MemoryLogger  # noqa: E402
from tests.support.helpers import TinyNet, end_script, hook_state  # noqa: E402


class Uneven(TinyNet):
    """TinyNet with Adam; rank 1 gets batches of 32 rows, rank 0 of 16."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16 * (1 + self.trainer.global_rank))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Sharded(Uneven):
    def configure_model(self) -> None:
        fully_shard(self, mesh=self.device_mesh["data_parallel"])


class Before(pl.Callback):
    """The hooks of the model once the strategy set it up (FSDP2 adds its own), before MemoryLogger's step."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = hook_state(pl_module)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, choices=["ddp", "fsdp"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    torch.manual_seed(0)
    fsdp = args.strategy == "fsdp"
    model = Sharded(n=64) if fsdp else Uneven(n=64)
    logger = MemoryLogger(exclude=["unused"])
    before = Before()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if fsdp
        else "ddp_find_unused_parameters_true",
        max_steps=3,
        logger=TensorBoardLogger(out, name="tb", version=0),
        callbacks=[before, logger],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    result = {
        "peak": logger.peak,
        "peak_at": logger.peak_at,
        "summary": logger.summary,
        "rows": len(logger.rows),
        "hooks_kept": hook_state(model) == before.state,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    end_script()

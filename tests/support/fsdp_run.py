"""A real 2-process FSDP2 fit on CPU (gloo), run by tests/integration/test_fsdp.py as a script.

    python tests/support/fsdp_run.py --mode fit|backward|fail|nan|tensor-parallel --out DIR

Lightning's ``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``: every parameter
becomes a ``DTensor`` sharded over the two processes. ``fit`` runs every callback, with
``GradClamp(mode="accumulated")``, and ``backward`` with ``GradClamp(mode="backward")``; ``fail`` makes
rank 1's ``training_step`` raise at step 1 while rank 0 goes on into FSDP's collectives;
``nan`` puts a NaN into rank 1's shard of ``fc2.weight``'s gradient at step 1;
``tensor-parallel`` runs them all with a tensor-parallel mesh of 2. Each rank writes what it saw to
``DIR/rank<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hooks import (  # noqa: E402
    ActivationStats,
    GradClamp,
    GradStats,
    HealthMonitor,
    NonFiniteGuard,
    ShapeLogger,
)
from tests.support.helpers import TinyNet, end_script, hook_state  # noqa: E402

CLAMP = 0.05
STEPS = 3


class ShardNet(TinyNet):
    """TinyNet with ``fc1`` and then the whole model sharded by FSDP2 over the data-parallel ranks."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.fc1, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def __init__(self, rank1_fails_at: int | None = None) -> None:
        super().__init__(batch_size=8)
        self.rank1_fails_at = rank1_fails_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.rank1_fails_at and self.global_rank == 1:
            raise RuntimeError("planned failure on rank 1")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        # Not shuffled, so that a single process can see the union of the ranks' batches in the same order.
        dataset = TensorDataset(self.x, self.y)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


class FastFc2(ShardNet):
    """``fc2`` learning 100 times faster than the rest: its update ratio leaves the healthy band."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        fast = list(self.fc2.parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in fast)]
        return torch.optim.SGD([{"params": rest}, {"params": fast, "lr": 100 * self.lr}], lr=self.lr)


def unsharded_hooks(model: torch.nn.Module) -> int:
    """Tensor hooks on FSDP2's unsharded parameters, which only FSDP's internals reach (a test's look)."""
    total = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else []:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                total += len(getattr(unsharded, "_backward_hooks", None) or {})
    return total


class PoisonRank1(pl.Callback):
    """At step 1, after FSDP reduce-scattered the gradients, a NaN in rank 1's shard of ``fc2.weight``'s only."""

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 1 and trainer.global_rank == 1:
            with torch.no_grad():
                pl_module.fc2.weight.grad.to_local()[0, 0] = float("nan")


class Record(pl.Callback):
    """First in the callback list: the hooks before ours attach, those on unsharded parameters
    during the steps, and each rank's batches."""

    def __init__(self) -> None:
        self.before: dict[str, tuple[int, ...]] = {}
        self.unsharded_hooks_in_step = 0
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.unsharded_hooks_in_step = max(self.unsharded_hooks_in_step, unsharded_hooks(pl_module))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = hook_state(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self.batches.append((batch[0].clone(), batch[1].clone()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode", required=True, choices=["fit", "backward", "fail", "nan", "tensor-parallel", "health"]
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    torch.manual_seed(0)
    model = FastFc2() if args.mode == "health" else ShardNet(rank1_fails_at=1 if args.mode == "fail" else None)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    record = Record()
    monitor = HealthMonitor(log_every_n_steps=1)
    callbacks: list[pl.Callback] = [record]
    if args.mode != "health":
        callbacks += [
            ShapeLogger(),
            GradStats(log_every_n_steps=1),
            ActivationStats(log_every_n_steps=1),
            GradClamp(CLAMP, mode="backward" if args.mode == "backward" else "accumulated"),
            NonFiniteGuard(),
            *([PoisonRank1()] if args.mode == "nan" else []),
        ]
    callbacks.append(monitor)
    tensor_parallel = 2 if args.mode == "tensor-parallel" else 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2 // tensor_parallel,
            tensor_parallel_size=tensor_parallel,
            timeout=timedelta(seconds=20),  # a rank left waiting for a failed one gives up
        ),
        max_steps=6 if args.mode == "health" else STEPS,
        logger=TensorBoardLogger(out, name="tb", version=0),
        callbacks=callbacks,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    result: dict[str, Any] = {}
    try:
        trainer.fit(model)
    except Exception as error:  # every outcome is reported, and judged by the test
        result["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    rank = trainer.global_rank
    result["hooks_kept"] = record.before == hook_state(model) and not unsharded_hooks(model) if record.before else None
    result["unsharded_hooks_in_step"] = record.unsharded_hooks_in_step
    result["findings"] = [(f.check, list(f.layers)) for f in monitor.findings]
    result["sharded"] = [name for name, p in model.named_parameters() if type(p).__name__ == "DTensor"]
    if "error" not in result:
        final = {name: p.full_tensor() for name, p in model.named_parameters()}  # a collective on every rank
        if rank == 0:
            torch.save(initial, out / "initial.pt")
            torch.save(final, out / "final.pt")
        torch.save(record.batches, out / f"batches_rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    end_script()

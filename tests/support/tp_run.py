"""Real tensor-parallel fits on CPU (gloo), run by tests/integration/test_tensor_parallel.py as a script.

    python tests/support/tp_run.py --mode dp2-tp2|hsdp|tp2 --out DIR

A two-block pre-norm transformer (attention and MLP) under Lightning's ``ModelParallelStrategy``:
``dp2-tp2`` on a 2 x 2 (data, tensor) mesh, attention and MLP projections column- and row-wise, norms and
residual stream sequence-parallel, then ``fully_shard`` over the data-parallel ranks; ``tp2`` is tensor
parallelism alone over two processes, norms replicated (plain parameters on every rank); ``hsdp`` is
``fully_shard`` on a 2-D (replicate, shard) mesh of four processes. Rank 0 writes the logs and
``initial.pt``; every rank ``rank<N>.json``.
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
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hooks import (  # noqa: E402
    ActivationStats,
    GradClamp,
    GradStats,
    HealthMonitor,
    MemoryLogger,
    NonFiniteError,
    NonFiniteGuard,
    ShapeLogger,
)
from tests.support.helpers import end_script  # noqa: E402

STEPS = 3
HEALTH_STEPS = 30
BATCH = 4  # per data-parallel rank
CLAMP = 0.005
MODES = {"dp2-tp2": (4, 2), "hsdp": (4, 1), "tp2": (2, 2)}
"""Processes and tensor-parallel size of each mode."""


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        # No key bias: softmax is blind to it, so its gradient is zero up to rounding, and its zero fraction noise.
        self.q, self.k, self.v, self.o = (
            nn.Linear(dim, dim),
            nn.Linear(dim, dim, bias=False),
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # The heads this process holds: all of them, or its share under tensor parallelism.
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim, head_dim=4)
        self.mlp_norm, self.up, self.act, self.down = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 2 * dim),
            nn.GELU(),
            nn.Linear(2 * dim, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.down(self.act(self.up(self.mlp_norm(x))))


class TransformerNet(pl.LightningModule):
    """Two blocks over a sequence of 6 vectors of 16, mean-pooled into 3 classes: the same weights in every mode."""

    def __init__(self, mode: str = "single", batch_size: int = BATCH, dead: bool = False) -> None:
        super().__init__()
        self.mode, self.batch_size = mode, batch_size
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.head = nn.Linear(16, 3)
        if dead:  # 24 of the first MLP's 32 units never fire: all 16 of tp rank 1's, half of rank 0's
            with torch.no_grad():
                self.blocks[0].up.bias[8:] = -100.0
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 6, 16, generator=generator)
        self.y = torch.randint(0, 3, (64,), generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_model(self) -> None:
        if self.mode == "single":
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        if self.mode == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)
            return
        tp = self.device_mesh["tensor_parallel"]
        sp = self.mode == "dp2-tp2"
        for block in self.blocks:
            plan: dict[str, Any] = {
                **{f"attention.{n}": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate()) for n in "qkv"},
                "attention.o": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                "up": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate()),
                "down": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            }
            if sp:
                plan.update({"attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
            parallelize_module(block, tp, plan)
        if sp:  # the sequence is split between the blocks, and gathered after them
            parallelize_module(
                self.blocks,
                tp,
                PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True),
            )
            parallelize_module(
                self.blocks, tp, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
            )
        if self.mode != "tp2":
            dp = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self, mesh=dp)

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(self.x, self.y)
        if self.mode == "single":
            return DataLoader(dataset, batch_size=self.batch_size)
        # Not shuffled: one process sees the union of the data-parallel ranks' batches, in order, as batches of
        # `BATCH x data-parallel size`.
        replicas, rank = (4, self.global_rank) if self.mode == "hsdp" else (1, 0)
        if self.mode == "dp2-tp2":
            dp = self.device_mesh["data_parallel"]
            replicas, rank = dp.size(), dp.get_local_rank()
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


class PoisonRank1(pl.Callback):
    """At step 1, a NaN in rank 1's shard of the first block's ``up`` weight: its output goes wrong on rank 1 first,
    and every rank's after the row-wise ``down`` sums the shards."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 1 and trainer.global_rank == 1:
            with torch.no_grad():
                pl_module.blocks[0].up.weight.to_local()[0, 0] = float("nan")


def callbacks() -> list[pl.Callback]:
    return [ShapeLogger(), GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=sorted(MODES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--backward-clamp", action="store_true", help="GradClamp(mode='backward'): refused")
    parser.add_argument("--guard", action="store_true", help="NonFiniteGuard and MemoryLogger, a NaN on rank 1")
    parser.add_argument("--health", action="store_true", help=f"HealthMonitor over {HEALTH_STEPS} steps, dead units")
    args = parser.parse_args()
    out = Path(args.out)
    processes, tensor_parallel = MODES[args.mode]
    model = TransformerNet(args.mode, dead=args.health)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    guard, memory, monitor = NonFiniteGuard(), MemoryLogger(at_step=0), HealthMonitor(log_every_n_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=processes,
        strategy=ModelParallelStrategy(
            data_parallel_size=processes // tensor_parallel,
            tensor_parallel_size=tensor_parallel,
            timeout=timedelta(seconds=60),
        ),
        max_steps=HEALTH_STEPS if args.health else STEPS,
        logger=TensorBoardLogger(out, name="tb", version=0),
        callbacks=[guard, memory, PoisonRank1()]
        if args.guard
        else [monitor]
        if args.health
        else [
            *callbacks(),
            GradClamp(CLAMP, mode="backward" if args.backward_clamp else "accumulated", log_every_n_steps=1),
            # Under HSDP the other callbacks ride along: they must run, and the ranks agree (judged by the test).
            *([guard, memory, monitor] if args.mode == "hsdp" else []),
        ],
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
    except NonFiniteError as error:
        result["finding"] = error.finding.lines(1) if error.finding is not None else None
        result["replayed"] = error.finding.replayed if error.finding is not None else None
        result["memory"] = {"rows": len(memory.rows), "peak": memory.peak, "summary": memory.summary}
    except Exception as error:  # every outcome is reported, and judged by the test
        result["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    result["placements"] = {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()}
    if "error" not in result:  # the trained weights, whole (a collective per sharded tensor: every rank takes part)
        final = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if trainer.global_rank == 0:
            torch.save(final, out / "final.pt")
    result["findings"] = [(f.check, list(f.layers), f.step, f.value) for f in monitor.findings]
    result.setdefault("memory", {"rows": len(memory.rows), "peak": memory.peak, "summary": memory.summary})
    if trainer.global_rank == 0:
        torch.save(initial, out / "initial.pt")
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    end_script()

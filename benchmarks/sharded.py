"""What a logging step costs under FSDP2 and a 2-D mesh against DDP on the same model (CPU processes, gloo).

    .venv/bin/python benchmarks/sharded.py                 # 2 interleaved repeats × 6 variants, ~8 min on 2 cores
    .venv/bin/python benchmarks/sharded.py --repeats 1     # a smoke run

Variants: ``ddp`` and ``fsdp2`` (``ModelParallelStrategy`` with ``fully_shard`` on every layer and
the root) in 2 processes, ``dp2-tp2`` (4 processes: three pairs of layers column- then row-wise
parallel over 2, then ``fully_shard`` over the other 2), each without callbacks and with ``GradStats`` +
``ActivationStats`` + ``GradClamp(mode="accumulated")`` logging every ``--every`` steps. Each fit runs in its own
pair of processes, variants in an order rotated every repeat. Rank 0 times each step from its
``on_train_batch_start`` to the next one's and counts the collectives made during it
(``all_reduce``, ``all_gather``, ``all_gather_object``, ``broadcast``, ``barrier``: the calls the
callbacks can make; FSDP's own all-gathers and reduce-scatters are other functions and not
counted). Figures are medians over repeats of each fit's median quiet step and median logging
step; "added" is a logging step minus a quiet step of the same fit, in wall time and in rank 0's
CPU time (``time.process_time``, less sensitive to other work on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_hooks import ActivationStats, GradClamp, GradStats  # noqa: E402

VARIANTS = ("ddp", "ddp+callbacks", "fsdp2", "fsdp2+callbacks", "dp2-tp2", "dp2-tp2+callbacks")
COUNTED = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")


class MLP(pl.LightningModule):
    """Eight 256-wide layers with ReLU between them: 0.5 M parameters, 16 tensors, 15 layer outputs."""

    def __init__(self, sharded: bool, tensor_parallel: bool = False) -> None:
        super().__init__()
        self.sharded, self.tensor_parallel = sharded, tensor_parallel
        self.layers = nn.Sequential(
            *[m for _ in range(7) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10)
        )
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(4096, 256, generator=generator)
        self.y = torch.randint(0, 10, (4096,), generator=generator)

    def configure_model(self) -> None:
        if self.tensor_parallel:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            pairs = {f"{i}": ColwiseParallel() for i in (0, 4, 8)} | {f"{i}": RowwiseParallel() for i in (2, 6, 10)}
            parallelize_module(self.layers, self.device_mesh["tensor_parallel"], pairs)
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(self.x, self.y)
        rank = self.device_mesh["data_parallel"].get_local_rank() if self.sharded else self.global_rank
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
        return DataLoader(dataset, batch_size=64, sampler=sampler)


class Meter(pl.Callback):
    """Per step on this rank: the time from its start to the next one's, and the collectives made in it."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.cpu: list[float] = []
        self.collectives: list[int] = []
        self.calls = 0
        for name in COUNTED:
            original = getattr(torch.distributed, name)
            setattr(torch.distributed, name, self._counting(original))

    def _counting(self, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if len(self.starts) > 1:
            self.collectives.append(self.calls)
        self.calls = 0


def fit(variant: str, steps: int, every: int, out: Path) -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    torch.manual_seed(0)
    tensor_parallel = variant.startswith("dp2-tp2")
    sharded = variant.startswith("fsdp2") or tensor_parallel
    meter = Meter()
    callbacks: list[pl.Callback] = [meter]
    if variant.endswith("+callbacks"):
        callbacks += [
            GradStats(log_every_n_steps=every),
            ActivationStats(log_every_n_steps=every),
            GradClamp(0.01, mode="accumulated", log_every_n_steps=every),
        ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4 if tensor_parallel else 2,
        strategy=(
            ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2 if tensor_parallel else 1)
            if sharded
            else DDPStrategy()
        ),
        max_steps=steps + 1,
        log_every_n_steps=every,
        logger=pl.loggers.TensorBoardLogger(out.parent, name=out.stem, version=0),
        callbacks=callbacks,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(MLP(sharded, tensor_parallel))
    if trainer.global_rank == 0:
        times = [b - a for a, b in zip(meter.starts, meter.starts[1:], strict=False)]
        cpu = [b - a for a, b in zip(meter.cpu, meter.cpu[1:], strict=False)]
        out.write_text(json.dumps({"times": times, "cpu": cpu, "collectives": meter.collectives}))


def summary(runs: list[dict[str, list[float]]], every: int, warmup: int) -> dict[str, float]:
    quiet, logging, added, cpu_added, collectives, quiet_collectives = [], [], [], [], [], []
    for run in runs:
        steps = range(warmup, len(run["times"]))
        q = [run["times"][s] * 1e3 for s in steps if s % every]
        lg = [run["times"][s] * 1e3 for s in steps if s % every == 0]
        quiet.append(statistics.median(q))
        logging.append(statistics.median(lg))
        added.append(logging[-1] - quiet[-1])
        cpu_q = statistics.median(run["cpu"][s] * 1e3 for s in steps if s % every)
        cpu_added.append(statistics.median(run["cpu"][s] * 1e3 for s in steps if s % every == 0) - cpu_q)
        collectives.append(statistics.median(run["collectives"][s] for s in steps if s % every == 0))
        quiet_collectives.append(statistics.median(run["collectives"][s] for s in steps if s % every))
    return {
        "quiet": statistics.median(quiet),
        "logging": statistics.median(logging),
        "added": statistics.median(added),
        "cpu_added": statistics.median(cpu_added),
        "collectives": statistics.median(collectives),
        "quiet_collectives": statistics.median(quiet_collectives),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # one fit (Lightning re-runs this command line for rank 1)
        fit(args.variant, args.steps, args.every, Path(args.out))
        return
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"sharded-bench-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, list[float]]]] = {v: [] for v in VARIANTS}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    for repeat in range(args.repeats):
        order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
        for variant in order:
            out = root / f"{variant.replace('+', '_')}-{repeat}.json"
            command = [sys.executable, __file__, "--variant", variant, "--out", str(out)]
            command += ["--steps", str(args.steps), "--every", str(args.every)]
            subprocess.run(command, check=True, env=env, capture_output=True, timeout=300)
            runs[variant].append(json.loads(out.read_text()))
    print(f"gloo, {args.repeats} repeats × {args.steps} steps, logging every {args.every}")
    print(
        "| variant | ms/step, quiet | ms/step, logging | logging / quiet | added per logging step "
        "| rank 0 CPU time added | collectives, quiet / logging |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for variant in VARIANTS:
        s = summary(runs[variant], args.every, args.warmup)
        print(
            f"| {variant} | {s['quiet']:.2f} | {s['logging']:.2f} | {s['logging'] / s['quiet']:.2f} "
            f"| {s['added']:+.2f} ms | {s['cpu_added']:+.2f} ms "
            f"| {s['quiet_collectives']:.0f} / {s['collectives']:.0f} |"
        )


if __name__ == "__main__":
    main()

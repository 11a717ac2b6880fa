"""Exploration: GradStats/ActivationStats under dp=2 x tp=2 against one process."""
import json, sys
from pathlib import Path
from datetime import timedelta
import torch, lightning.pytorch as pl
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
sys.path.insert(0, "/work/main")
import lightning_hooks.callbacks.base as base
from lightning_hooks import GradStats, ActivationStats

base.HookCallback.setup = lambda self, trainer, pl_module, stage: None

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.act = nn.ReLU()
        self.down = nn.Linear(2 * d, d)
    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))

class Net(pl.LightningModule):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.head = nn.Linear(8, 3)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(32, 6, 8, generator=g)
        self.y = torch.randint(0, 3, (32,), generator=g)
    def configure_model(self):
        if self.mode == "single":
            return
        from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import SequenceParallel
        from torch.distributed.tensor import Shard, Replicate
        from torch.distributed.device_mesh import init_device_mesh
        if self.mode == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            for b in self.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(self, mesh=mesh)
            return
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for b in self.blocks:
            if self.mode == "dtensor":
                plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()}
            elif self.mode == "sp":
                plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}
                from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput
            else:
                plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(b, tp, plan)
        if self.mode == "sp":
            from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput
            parallelize_module(self.blocks, tp, PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True))
            parallelize_module(self.blocks, tp, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()))
        for b in self.blocks:
            fully_shard(b, mesh=dp)
        fully_shard(self, mesh=dp)
    def forward(self, x):
        return self.head(self.blocks(x).mean(1))
    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        ds = TensorDataset(self.x, self.y)
        if self.mode == "single":
            return DataLoader(ds, batch_size=8)
        from torch.utils.data import DistributedSampler
        if self.mode == "hsdp":
            return DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=4, rank=self.global_rank, shuffle=False))
        dp = self.device_mesh["data_parallel"]
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=dp.get_local_rank(), shuffle=False))

class Dbg(pl.Callback):
    def on_fit_start(self, trainer, m):
        import os
        if m.mode == "sp" and os.environ.get("DBG"):
            def h(mod, gi, go, r=trainer.global_rank):
                print("BW", r, trainer.global_step, [tuple(g.shape) for g in go], [float(g.double().norm()) for g in go], flush=True)
            m.blocks[1].register_full_backward_hook(h)
            m.blocks[1].down.register_full_backward_hook(h)
    def on_train_batch_start(self, trainer, m, batch, i):
        if trainer.global_step == 0:
            w = float(sum(p.full_tensor().double().sum() if hasattr(p, "full_tensor") else p.double().sum() for p in m.parameters()))
            print("RANK", trainer.global_rank, "x", batch[0].shape, float(batch[0].sum()), "w", w, flush=True)
mode, out = sys.argv[1], Path(sys.argv[2])
model = Net(mode)
kw = dict(accelerator="cpu", devices=1) if mode == "single" else dict(
    accelerator="cpu", devices=4, strategy=ModelParallelStrategy(data_parallel_size=4 if mode == "hsdp" else 2, tensor_parallel_size=1 if mode == "hsdp" else 2, timeout=timedelta(seconds=60)))
trainer = pl.Trainer(**kw, max_steps=2, logger=CSVLogger(out, name="csv", version=0),
    callbacks=[Dbg(), GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)], enable_progress_bar=False, use_distributed_sampler=False,
    enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
trainer.fit(model)
if trainer.global_rank == 0:
    print("PLACEMENTS", [(n, str(getattr(p, "placements", None))) for n, p in model.named_parameters()][:6])

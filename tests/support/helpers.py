"""Small real models, a Trainer factory and TensorBoard readers shared by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CUDA = (pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))
"""The marks of a test that needs a CUDA GPU: selected by ``pytest -m cuda``, skipped without one."""


def devices() -> list[Any]:
    """``"cpu"`` and ``"cuda"`` as parameters, the second with :data:`CUDA`'s marks."""
    return [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]


class TinyNet(pl.LightningModule):
    """An MLP whose ReLU module is called twice per forward, with a layer that never runs.

    ``fail_at`` makes ``training_step`` raise ``fail_with`` at that global step.
    """

    def __init__(
        self,
        lr: float = 0.1,
        n: int = 40,
        batch_size: int = 16,
        fail_at: int | None = None,
        fail_with: type = RuntimeError,
    ) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.act = nn.ReLU()
        self.unused = nn.Linear(2, 2)
        self.lr, self.n, self.batch_size, self.fail_at, self.fail_with = lr, n, batch_size, fail_at, fail_with
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator) * 3
        self.y = torch.randint(0, 3, (n,), generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc2(self.act(self.fc1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise self.fail_with("planned failure")
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:5], self.y[:5]), batch_size=5)


class Probe(pl.Callback):
    """Calls ``look(trainer, pl_module)`` at a hook of the fit, after the callbacks listed before it ran theirs."""

    def __init__(self, hook: str, look: Any) -> None:
        self.seen: list[Any] = []
        setattr(self, hook, lambda trainer, pl_module, *args: self.seen.append(look(trainer, pl_module, *args)))


class NaNWeight(pl.Callback):
    """Sets one value of ``module``'s weight to NaN as step ``at`` begins."""

    def __init__(self, module: str, at: int) -> None:
        self.module, self.at = module, at

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at:
            with torch.no_grad():
                pl_module.get_submodule(self.module).weight.view(-1)[0] = float("nan")


class ScaleLog(pl.Callback):
    """The GradScaler's scale after each optimizer step, in ``scales``."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def fp16() -> MixedPrecision:
    """Real fp16 autocast with an enabled GradScaler on CPU (``precision="16-mixed"`` would become bf16 there)."""
    return MixedPrecision("16-mixed", "cpu")


def make_trainer(
    tmp_path: Path, callbacks: list[pl.Callback], *, logger: bool | Logger = True, **kwargs: Any
) -> pl.Trainer:
    """A quiet CPU Trainer logging to TensorBoard under ``tmp_path``, ``kwargs`` overriding its options;
    ``strategy="ddp_spawn"`` or ``"ddp_fork"`` runs as :class:`EndingDDP`."""
    options: dict[str, Any] = {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "log_every_n_steps": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "logger": TensorBoardLogger(tmp_path, name="tb", version=0) if logger is True else logger,
    }
    options.update(kwargs)
    if options.get("strategy") in ("ddp_spawn", "ddp_fork"):
        options["strategy"] = EndingDDP(start_method=options["strategy"].removeprefix("ddp_"))
    return pl.Trainer(callbacks=callbacks, **options)


def events(root: Path) -> EventAccumulator:
    """Everything written under ``root``, read back with TensorBoard's own reader."""
    dirs = sorted({p.parent for p in Path(root).rglob("events.out.tfevents.*")})
    assert len(dirs) == 1, f"expected one run directory under {root}, found {dirs}"
    accumulator = EventAccumulator(str(dirs[0]), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def scalars(root: Path, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in events(root).Scalars(tag)}


def texts(root: Path, tag: str) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events(root).Tensors(tag)}


_GLOBAL_HOOKS = (
    "forward_pre_hooks",
    "forward_hooks",
    "forward_hooks_with_kwargs",
    "forward_hooks_always_called",
    "backward_pre_hooks",
    "backward_hooks",
    "module_registration_hooks",
)


def hook_state(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """How many hooks of each kind every module and parameter holds."""
    state: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        state[f"module:{name}"] = tuple(
            len(getattr(module, attr))
            for attr in (
                "_forward_hooks",
                "_forward_pre_hooks",
                "_forward_hooks_with_kwargs",
                "_forward_pre_hooks_with_kwargs",
                "_forward_hooks_always_called",
                "_backward_hooks",
                "_backward_pre_hooks",
            )
        )
    # Hooks on every module of the process (a one-step recorder's): none may outlive it either.
    state["global"] = tuple(len(getattr(torch.nn.modules.module, f"_global_{kind}")) for kind in _GLOBAL_HOOKS)
    for name, param in model.named_parameters():
        state[f"param:{name}"] = (
            len(param._backward_hooks or {}),
            len(getattr(param, "_post_accumulate_grad_hooks", None) or {}),
        )
    return state


def run_script(script: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with this interpreter from the repository's root, as a fresh launch: without the launcher's
    variables this process may hold (``LOCAL_RANK``, ``MASTER_PORT``...), so that the script starts its own ranks.
    ``timeout`` fails a hung rank's test instead of hanging it."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))
    }
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=Path(__file__).parents[2],
    )


def end_script() -> NoReturn:
    """End a multi-process test script once this rank has written its results: wait for every rank's, then leave
    without the interpreter's shutdown, where gloo's threads have aborted runs that had finished and written
    everything (SIGABRT, "terminate called without an active exception", in about one CI run in five)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's results are on disk before the launching process ends
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _EndingLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for ``ddp_spawn`` and ``ddp_fork``, whose processes end as :func:`end_script` does once
    the fit's results are handed back, instead of in the interpreter's shutdown (Lightning leaves their process
    group up)."""

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(process_idx, *args, **kwargs)
        end_script()


class EndingDDP(DDPStrategy):
    """``DDPStrategy(start_method=...)`` for ``spawn`` and ``fork``, with :class:`_EndingLauncher`: the strategy
    the tests use for ``ddp_spawn`` and ``ddp_fork``, so that a finished rank cannot abort in gloo's shutdown."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = _EndingLauncher(self, start_method=self._start_method)

"""Precisions: bf16 autocast, fp16 with a real GradScaler on CPU, and float64."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_hooks import ActivationStats, GradClamp, GradStats, HealthMonitor, NonFiniteGuard, ShapeLogger
from tests.support.helpers import ScaleLog, TinyNet, fp16, make_trainer, scalars


class Overflow(TinyNet):
    """Blows the fp16 gradients up to inf at ``overflow_at``."""

    overflow_at = 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        return loss * 1e10 if self.global_step == self.overflow_at else loss


def test_bf16_mixed_runs_every_callback(tmp_path: Path) -> None:
    callbacks = [ShapeLogger(), GradClamp(0.1), GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)]
    make_trainer(tmp_path, callbacks, precision="bf16-mixed", max_steps=3).fit(TinyNet())
    assert sorted(scalars(tmp_path, "act_mean/fc1")) == [0, 1, 2]
    assert all(0 < v < 1e3 for v in scalars(tmp_path, "out_grad_norm/fc1").values())


class Weights(pl.Callback):
    """``head.weight`` at each step's start and end."""

    def __init__(self) -> None:
        self.before: dict[int, torch.Tensor] = {}
        self.after: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before[trainer.global_step] = pl_module.head.weight.detach().clone()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after[trainer.global_step - 1] = pl_module.head.weight.detach().clone()


def test_a_float64_fit_runs_every_callback(tmp_path: Path) -> None:
    weights = Weights()
    callbacks = [ShapeLogger(), GradClamp(10.0), GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)]
    callbacks += [NonFiniteGuard(), HealthMonitor(log_every_n_steps=1), weights]
    make_trainer(tmp_path, callbacks, precision="64-true", max_steps=3).fit(TinyNet())
    for step in range(3):
        before, after = weights.before[step], weights.after[step]
        assert before.dtype == torch.float64
        ratio = torch.linalg.vector_norm(after - before) / torch.linalg.vector_norm(before)
        assert scalars(tmp_path, "update_ratio/head.weight")[step] == pytest.approx(
            float(ratio), rel=1e-6
        )  # float32 in the event file
    assert sorted(scalars(tmp_path, "act_mean/fc1")) == [0, 1, 2]


@pytest.mark.parametrize("mode", ["backward", "accumulated"])
def test_grad_clamp_equals_lightning_clipping_under_a_grad_scaler(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    start = Overflow(lr=0.5)
    runs = {}
    for name, callbacks, kwargs in (
        ("clamp", [GradClamp(0.02, mode=mode)], {}),
        ("clip", [], {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}),
        ("free", [], {}),
    ):
        model, scales = copy.deepcopy(start), ScaleLog()
        make_trainer(tmp_path / name, [*callbacks, scales], logger=False, max_steps=4, plugins=[fp16()], **kwargs).fit(
            model
        )
        runs[name] = (model, scales.scales)
    clamped, clipped, free = (runs[n][0] for n in ("clamp", "clip", "free"))
    for (name, a), b in zip(clamped.named_parameters(), clipped.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    assert not all(torch.allclose(a, c) for a, c in zip(clamped.parameters(), free.parameters(), strict=True))
    # The overflow at step 1 was still seen: the scaler skipped it and halved its scale.
    assert runs["clamp"][1] == runs["clip"][1]
    assert runs["clamp"][1][0] == 65536.0
    assert runs["clamp"][1][1] == 32768.0


def test_statistics_are_unscaled(tmp_path: Path) -> None:
    torch.manual_seed(0)
    start = TinyNet()
    for name, plugins in (("fp32", []), ("fp16", [fp16()])):
        make_trainer(tmp_path / name, [GradStats()], max_steps=1, plugins=plugins).fit(copy.deepcopy(start))
    for tag in ("out_grad_norm/fc1", "out_grad_abs_max/head", "grad_norm/fc1.weight", "grad_norm_total"):
        # fp16 autocast rounds activations; a loss scale of 65536 would be far outside this.
        assert scalars(tmp_path / "fp16", tag)[0] == pytest.approx(scalars(tmp_path / "fp32", tag)[0], rel=2e-2), tag


def test_clamped_fraction_is_counted_in_true_units(tmp_path: Path) -> None:
    torch.manual_seed(0)
    start = TinyNet()
    for name, plugins in (("fp32", []), ("fp16", [fp16()])):
        make_trainer(tmp_path / name, [GradClamp(0.05)], max_steps=1, plugins=plugins).fit(copy.deepcopy(start))
    fp32 = scalars(tmp_path / "fp32", "grad_clamp/clamped_fraction")[0]
    assert 0 < fp32 < 1
    assert scalars(tmp_path / "fp16", "grad_clamp/clamped_fraction")[0] == pytest.approx(fp32, abs=0.05)

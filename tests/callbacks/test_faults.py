"""Runs that go wrong: the callbacks never add a crash, never leave a hook, never lose what was logged."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hooks import ActivationStats, GradClamp, GradStats, ShapeLogger
from tests.support.helpers import TinyNet, hook_state, make_trainer, scalars, texts


def every_callback() -> list[pl.Callback]:
    return [ShapeLogger(), GradClamp(0.05), GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)]


class NaNLoss(TinyNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * float("nan")


class InfLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("inf")


class EmitsInf(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.blow = InfLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blow(self.act(self.fc2(self.act(self.fc1(x))))))


class SkipsSteps(TinyNet):
    """Returns ``None`` from ``training_step`` on odd batches: Lightning skips backward and the step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("model_class", [NaNLoss, EmitsInf, SkipsSteps])
def test_faulty_models_run_to_the_end(tmp_path: Path, model_class: type[TinyNet]) -> None:
    model = model_class()
    before = hook_state(model)
    make_trainer(tmp_path, every_callback(), max_steps=3).fit(model)
    assert hook_state(model) == before
    assert 0 in texts(tmp_path, "shapes/train")
    assert 0 in scalars(tmp_path, "act_mean/fc1")
    if model_class is EmitsInf:
        assert scalars(tmp_path, "act_nonfinite/blow")[0] > 0
        assert scalars(tmp_path, "act_nonfinite/fc2")[0] == 0
    if model_class is NaNLoss:
        assert math.isnan(scalars(tmp_path, "grad_norm/fc1.weight")[0])
    if model_class is SkipsSteps:
        # Lightning still counts the skipped batch as optimizer step 1, with no gradient to report.
        assert sorted(scalars(tmp_path, "grad_norm/fc1.weight")) == [0, 2]
        assert sorted(scalars(tmp_path, "act_mean/fc1")) == [0, 2]


class FailsInBackward(TinyNet):
    """Raises from inside autograd on step 2, a logging step, while every hook is attached."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2:
            loss.register_hook(_raise)
        return loss


def _raise(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("failure in the middle of a logging step")


def test_exception_in_the_middle_of_a_logging_step(tmp_path: Path) -> None:
    model = FailsInBackward()
    before = hook_state(model)
    with pytest.raises(RuntimeError, match="failure in the middle of a logging step"):
        make_trainer(tmp_path, every_callback(), max_steps=5).fit(model)
    assert hook_state(model) == before
    assert sorted(scalars(tmp_path, "grad_norm/fc1.weight")) == [0, 1]
    assert 0 in texts(tmp_path, "shapes/train")


def test_nan_loss_does_not_break_later_steps(tmp_path: Path) -> None:
    class OnceNaN(TinyNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            return loss * float("nan") if self.global_step == 1 else loss

    make_trainer(tmp_path, [GradStats(log_every_n_steps=1)], max_steps=2).fit(OnceNaN())
    logged = scalars(tmp_path, "grad_nonfinite/head.weight")
    assert logged[0] == 0
    assert logged[1] == 24

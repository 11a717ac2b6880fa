"""Gradient accumulation: logging counts optimizer steps; the two GradClamp modes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_hooks import ActivationStats, GradClamp, GradStats
from tests.support.helpers import TinyNet, make_trainer, scalars


class GradAtStep(pl.Callback):
    def __init__(self) -> None:
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads[trainer.global_step] = {
            n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None
        }


def test_backward_mode_clamps_each_micro_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet(batch_size=8, lr=0.5)
    reference = copy.deepcopy(model)
    grads = GradAtStep()
    make_trainer(tmp_path, [GradClamp(0.02), grads], logger=False, max_steps=1, accumulate_grad_batches=2).fit(model)
    # By hand: clamp(g1) + clamp(g2), each of a loss that Lightning divides by 2.
    total = None
    for start in (0, 8):
        reference.zero_grad()
        (F.cross_entropy(reference(reference.x[start : start + 8]), reference.y[start : start + 8]) / 2).backward()
        part = [p.grad.clamp(-0.02, 0.02) for p in reference.parameters() if p.grad is not None]
        total = part if total is None else [a + b for a, b in zip(total, part, strict=True)]
    assert total is not None
    accumulated = list(grads.grads[0].values())
    for got, want in zip(accumulated, total, strict=True):
        assert torch.allclose(got, want, atol=1e-7)
    largest = max(float(g.abs().max()) for g in accumulated)
    assert 0.02 < largest <= 0.04 + 1e-6  # can exceed `value`, never 2 * value


def test_accumulated_mode_equals_lightning_clipping(tmp_path: Path) -> None:
    torch.manual_seed(0)
    start = TinyNet(batch_size=8, lr=0.5)
    clamped, clipped = copy.deepcopy(start), copy.deepcopy(start)
    common: dict[str, Any] = {"logger": False, "max_steps": 3, "accumulate_grad_batches": 2}
    make_trainer(tmp_path / "a", [GradClamp(0.02, mode="accumulated")], **common).fit(clamped)
    make_trainer(tmp_path / "b", [], gradient_clip_val=0.02, gradient_clip_algorithm="value", **common).fit(clipped)
    for (name, a), b in zip(clamped.named_parameters(), clipped.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7), name


def test_statistics_count_optimizer_steps_and_read_the_accumulated_gradient(tmp_path: Path) -> None:
    grads = GradAtStep()
    callbacks = [GradStats(log_every_n_steps=2), ActivationStats(log_every_n_steps=2), GradClamp(0.05), grads]
    model = TinyNet(batch_size=8, n=64)
    initial = copy.deepcopy(model)
    make_trainer(tmp_path, callbacks, max_steps=5, accumulate_grad_batches=2).fit(model)
    for tag in ("grad_norm/fc1.weight", "act_mean/fc1", "grad_clamp/clamped_fraction", "out_grad_norm/fc2"):
        assert sorted(scalars(tmp_path, tag)) == [0, 2, 4], tag
    for step in (0, 2, 4):
        want = float(torch.linalg.vector_norm(grads.grads[step]["fc1.weight"]))
        assert scalars(tmp_path, "grad_norm/fc1.weight")[step] == pytest.approx(want, rel=1e-5)
    # Activation statistics pool both micro-batches of step 0 (both ran with the initial weights).
    out = initial.fc1(initial.x[:16]).detach().double()
    assert scalars(tmp_path, "act_mean/fc1")[0] == pytest.approx(float(out.mean()), rel=1e-5)
    assert scalars(tmp_path, "act_std/fc1")[0] == pytest.approx(float(out.std(correction=0)), rel=1e-5)

"""validate / test / predict, repeated fits, shared models, manual optimization with two optimizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStats, GradClamp, GradStats, ShapeLogger
from tests.support.helpers import TinyNet, events, hook_state, make_trainer, scalars


def every_callback() -> list[pl.Callback]:
    return [ShapeLogger(), GradClamp(0.05), GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)]


class Evaluated(TinyNet):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
def test_evaluation_entry_points_attach_nothing(tmp_path: Path, entry: str) -> None:
    model = Evaluated()
    before = hook_state(model)
    seen: list[dict] = []

    class Spy(pl.Callback):
        def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            seen.append(hook_state(pl_module))

        on_test_batch_start = on_predict_batch_start = on_validation_batch_start

    trainer = make_trainer(tmp_path, [*every_callback(), Spy()], limit_val_batches=1)
    getattr(trainer, entry)(model)
    assert seen == [before]
    assert hook_state(model) == before
    if list(tmp_path.rglob("events.out.tfevents.*")):
        logged = events(tmp_path).Tags()
        assert not [t for t in logged["scalars"] if t.startswith(("act_", "grad", "out_grad"))]
        assert "shapes/train" not in logged["tensors"]


def test_fit_twice_on_one_trainer_and_two_trainers_sharing_a_model(tmp_path: Path) -> None:
    model = TinyNet()
    before = hook_state(model)
    callbacks = every_callback()
    trainer = make_trainer(tmp_path / "a", callbacks, max_steps=2)
    trainer.fit(model)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model)
    other = make_trainer(tmp_path / "b", every_callback(), max_steps=2)
    other.fit(model)
    assert hook_state(model) == before
    assert sorted(scalars(tmp_path / "a", "grad_norm/fc1.weight")) == [0, 1, 2, 3]
    assert sorted(scalars(tmp_path / "b", "grad_norm/fc1.weight")) == [0, 1]


class TwoOptimizers(TinyNet):
    """Manual optimization: the body and the head have their own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.grads_at_step: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        body, head = self.optimizers()  # type: ignore[misc]
        x, y = batch
        loss = F.cross_entropy(self(x), y) * 50
        self.manual_backward(loss)
        self.grads_at_step.append({n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None})
        body.step()
        head.step()
        body.zero_grad()
        head.zero_grad()

    def configure_optimizers(self) -> Any:
        body = [p for n, p in self.named_parameters() if not n.startswith("head")]
        return torch.optim.SGD(body, lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


def test_manual_optimization_with_two_optimizers(tmp_path: Path) -> None:
    model = TwoOptimizers()
    # Each `optimizer.step()` advances `global_step`: two per batch.
    make_trainer(tmp_path, [GradClamp(0.01), GradStats(log_every_n_steps=2)], max_steps=4).fit(model)
    bound = torch.tensor(0.01)
    assert all(bool((g.abs() <= bound).all()) for grads in model.grads_at_step for g in grads.values())
    logged = scalars(tmp_path, "grad_norm/head.weight")
    assert sorted(logged) == [0, 2]
    assert logged[0] == pytest.approx(float(torch.linalg.vector_norm(model.grads_at_step[0]["head.weight"])), rel=1e-5)
    assert sorted(scalars(tmp_path, "grad_norm/fc1.weight")) == [0, 2]
    assert sorted(scalars(tmp_path, "update_ratio/head.weight")) == [0, 2]

"""Histograms count every call and every micro-batch of a logging step, read back with TensorBoard's reader."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStats
from tests.support.helpers import events, make_trainer


class Watched(pl.LightningModule):
    """``probe`` (an identity) sees the batch; with ``twice`` it sees the batch shifted by 10 as well."""

    def __init__(self, x: torch.Tensor, batch_size: int, twice: bool) -> None:
        super().__init__()
        self.probe, self.fc = nn.Identity(), nn.Linear(4, 1)
        self.x, self.batch_size, self.twice = x, batch_size, twice

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.fc(self.probe(x)).square().mean()
        if self.twice:
            loss = loss + self.fc(self.probe(x[:, :3].repeat(1, 2)[:, :4] + 10)).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x), batch_size=self.batch_size)


def logged_histogram(tmp_path: Path, model: Watched, **trainer_kwargs: Any) -> Any:
    stats = ActivationStats(log_every_n_steps=1, include=["probe"], histograms=True)
    make_trainer(tmp_path, [stats], max_steps=1, **trainer_kwargs).fit(model)
    (event,) = events(tmp_path).Histograms("act/probe")
    assert event.step == 0
    return event.histogram_value


def assert_counts_every_value(hist: Any, values: torch.Tensor) -> None:
    values = values.double().flatten()
    assert hist.num == values.numel()
    assert sum(hist.bucket) == values.numel()
    assert (hist.min, hist.max) == (pytest.approx(float(values.min())), pytest.approx(float(values.max())))
    expected = torch.histc(values, bins=len(hist.bucket), min=float(values.min()), max=float(values.max()))
    assert list(hist.bucket) == expected.tolist()


def test_a_module_called_twice_with_disjoint_ranges(tmp_path: Path) -> None:
    x = torch.rand(16, 4, generator=torch.Generator().manual_seed(0))
    hist = logged_histogram(tmp_path, Watched(x, batch_size=16, twice=True))
    second = x[:, :3].repeat(1, 2)[:, :4] + 10
    assert_counts_every_value(hist, torch.cat([x.flatten(), second.flatten()]))
    assert hist.bucket[0] > 0
    assert hist.bucket[-1] > 0


def test_a_step_of_three_micro_batches(tmp_path: Path) -> None:
    base = torch.rand(24, 4, generator=torch.Generator().manual_seed(1))
    x = base + torch.arange(3).repeat_interleave(8).unsqueeze(1) * 10  # micro-batch i in [10 i, 10 i + 1)
    hist = logged_histogram(tmp_path, Watched(x, batch_size=8, twice=False), accumulate_grad_batches=3)
    assert_counts_every_value(hist, x)


class Shared(pl.LightningModule):
    """``block`` returns what its one child returns: the same tensor, two modules' output."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.block, self.x = nn.Sequential(nn.Linear(4, 4)), x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.block(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x), batch_size=len(self.x))


def test_an_output_two_modules_return_gets_its_histogram_under_both_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Shared(torch.randn(32, 4))
    with torch.no_grad():
        values = model.block(model.x)  # what the one step sees (weights before it)
    stats = ActivationStats(log_every_n_steps=1, include=["block", "block.0"], histograms=True)
    make_trainer(tmp_path, [stats], max_steps=1).fit(model)
    read = events(tmp_path)
    (outer,), (inner,) = read.Histograms("act/block"), read.Histograms("act/block.0")
    assert outer.histogram_value == inner.histogram_value
    hist = outer.histogram_value
    assert_counts_every_value(hist, values)
    width = (hist.max - hist.min) / len(hist.bucket)
    assert list(hist.bucket_limit) == [hist.min + width * (i + 1) for i in range(len(hist.bucket))]

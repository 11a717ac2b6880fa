"""torch.compile: clean names, no graph break on quiet steps, and a clear word when hooks cannot fire."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from lightning_hooks import ActivationStats, GradStats, ShapeLogger
from tests.helpers import TinyNet, events, make_trainer, scalars, texts


class CompiledBody(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)))
        del self.unused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class QuietStepBreaks(pl.Callback):
    """Counts graph breaks that happen during steps on which nothing is logged."""

    def __init__(self, every: int) -> None:
        self.every, self.breaks = every, 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._before = sum(counters["graph_break"].values())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.global_step - 1) % self.every:
            self.breaks += sum(counters["graph_break"].values()) - self._before


def callbacks() -> list[pl.Callback]:
    return [ShapeLogger(log_every_n_steps=2), ActivationStats(log_every_n_steps=2), GradStats(log_every_n_steps=2)]


def test_with_hook_guards_hooks_fire_with_clean_names(tmp_path: Path) -> None:
    torch._dynamo.reset()
    quiet = QuietStepBreaks(every=2)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        make_trainer(tmp_path, [*callbacks(), quiet], max_steps=5, log_every_n_steps=2).fit(CompiledBody())
    tags = events(tmp_path).Tags()["scalars"]
    assert sorted(scalars(tmp_path, "act_mean/body.0")) == [0, 2, 4]
    assert "out_grad_norm/body.2" in tags
    assert "grad_norm/body.0.weight" in tags
    assert not [t for t in tags if "_orig_mod" in t]
    assert "| body.0 | Linear | [16, 4] | [16, 8] |" in texts(tmp_path, "shapes/train")[0]
    assert quiet.breaks == 0


def test_hooks_added_after_compilation_are_reported_with_the_fix(tmp_path: Path) -> None:
    torch._dynamo.reset()
    model = CompiledBody()
    make_trainer(tmp_path / "plain", [], logger=False, max_steps=2).fit(model)  # compiled without hooks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path / "hooked", callbacks(), max_steps=1).fit(model)
    never = [str(w.message) for w in caught if "never ran" in str(w.message)]
    assert len(never) == 1
    assert "body.0" in never[0]
    assert "skip_nnmodule_hook_guards = False" in never[0]
    assert "act_mean/head" in events(tmp_path / "hooked").Tags()["scalars"]  # eager parts still work

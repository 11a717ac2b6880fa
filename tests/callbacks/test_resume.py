"""Checkpoint and resume: callback state travels in the checkpoint, logging resumes on schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hooks import GradClamp, GradStats, ShapeLogger
from tests.support.helpers import TinyNet, make_trainer, scalars, texts


def test_resumed_fit_logs_on_schedule_and_does_not_reprint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    first = make_trainer(
        tmp_path / "one",
        [ShapeLogger(), GradStats(log_every_n_steps=2), checkpoint],
        max_steps=3,
        enable_checkpointing=True,
    )
    first.fit(TinyNet(n=64))
    assert capsys.readouterr().out.count("ShapeLogger:") == 1
    stored = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    assert any(key.startswith("ShapeLogger") and value["logged_tables"] for key, value in stored.items())

    # A new process would build new callback instances: their state comes from the checkpoint.
    second = make_trainer(tmp_path / "two", [ShapeLogger(), GradStats(log_every_n_steps=2)], max_steps=7)
    second.fit(TinyNet(n=64), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert capsys.readouterr().out.count("ShapeLogger:") == 0, "same shapes: no second table"
    assert sorted(scalars(tmp_path / "two", "grad_norm/fc1.weight")) == [4, 6]
    with pytest.raises(KeyError):
        texts(tmp_path / "two", "shapes/train")


def test_two_instances_keep_separate_state() -> None:
    a, b = ShapeLogger(types=["Linear"]), ShapeLogger(types=["ReLU"])
    assert a.state_key != b.state_key
    assert ShapeLogger().state_key == ShapeLogger().state_key
    assert GradClamp(0.1, include=["fc1"]).state_key != GradClamp(0.1).state_key
    a.load_state_dict({"logged_tables": ["abc"]})
    assert a.state_dict() == {"logged_tables": ["abc"]}
    assert b.state_dict() == {"logged_tables": []}

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hooks import ShapeLogger, trace_shapes
from lightning_hooks._shapes import format_markdown
from tests.helpers import TinyNet, make_trainer, texts


def test_first_step_prints_and_logs_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = TinyNet()
    make_trainer(tmp_path, [ShapeLogger()], max_steps=1).fit(model)
    out = capsys.readouterr().out
    assert "ShapeLogger: TinyNet · step 0 · batch 0: [16, 4], 1: [16]" in out
    assert re.search(r"^fc1\s+Linear\s+\[16, 4\]\s+\[16, 8\]\s+40$", out, re.MULTILINE)
    logged = texts(tmp_path, "shapes/train")
    assert list(logged) == [0]
    expected = format_markdown(trace_shapes(TinyNet(), torch.zeros(16, 4)))
    assert logged[0].endswith(expected)
    assert "| fc1 | Linear | [16, 4] | [16, 8] | 40 |" in logged[0]


def test_reused_module_gets_a_row_per_call_in_execution_order(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ShapeLogger()], max_steps=1).fit(TinyNet())
    rows = [line.split(" | ")[0].lstrip("| ") for line in texts(tmp_path, "shapes/train")[0].splitlines()[4:]]
    assert rows == ["root", "fc1", "act", "fc2", "act", "head"]


def test_logs_again_only_for_a_new_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 40 samples in batches of 16: steps 0, 1 see 16 rows, step 2 sees 8; the next epoch repeats.
    make_trainer(tmp_path, [ShapeLogger(log_every_n_steps=1)], max_steps=6).fit(TinyNet())
    logged = texts(tmp_path, "shapes/train")
    assert list(logged) == [0, 2]
    assert "[8, 4]" in logged[2]
    assert "[16, 4]" not in logged[2]
    assert capsys.readouterr().out.count("ShapeLogger:") == 2


def test_validation_and_sanity_check_are_not_recorded(tmp_path: Path) -> None:
    # The validation batch has 5 rows; no table may show them.
    trainer = make_trainer(
        tmp_path,
        [ShapeLogger(log_every_n_steps=1)],
        max_steps=6,
        num_sanity_val_steps=1,
        limit_val_batches=1,
        val_check_interval=2,
    )
    trainer.fit(TinyNet())
    logged = texts(tmp_path, "shapes/train")
    assert logged
    assert all("[5, 4]" not in text for text in logged.values())


def test_prints_without_any_logger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_trainer(tmp_path, [ShapeLogger()], logger=False, max_steps=1).fit(TinyNet())
    assert re.search(r"^head\s+Linear\s+\[16, 8\]\s+\[16, 3\]\s+27$", capsys.readouterr().out, re.MULTILINE)
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


class KwargsNet(TinyNet):
    """``forward`` takes a keyword-only argument and returns a dict with a ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.scaler = Scale()

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        h = self.scaler(self.fc1(x), factor=torch.tensor(2.0))
        return {"logits": self.head(self.act(self.fc2(h))), "aux": None}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x)["logits"], y)


class Scale(nn.Module):
    def forward(self, x: torch.Tensor, *, factor: torch.Tensor) -> torch.Tensor:
        return x * factor


def test_keyword_inputs_and_dict_outputs(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ShapeLogger(include=["", "scaler"])], max_steps=1).fit(KwargsNet())
    table = texts(tmp_path, "shapes/train")[0]
    assert "| scaler | Scale | 0: [16, 8], factor: [] | [16, 8] | 0 |" in table
    assert "| root | KwargsNet | [16, 4] | logits: [16, 3], aux: None |" in table


def test_selection_arguments_reach_the_table(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ShapeLogger(types=["Linear"], exclude=["fc2"])], max_steps=1).fit(TinyNet())
    table = texts(tmp_path, "shapes/train")[0]
    assert [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[4:]] == ["fc1", "head"]

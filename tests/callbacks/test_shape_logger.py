import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import TQDMProgressBar
from torch import nn

from lightning_hooks import ShapeLogger, trace_shapes
from lightning_hooks.recorders.shapes import format_markdown, format_table
from tests.support.helpers import TinyNet, make_trainer, texts


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


def test_a_second_table_says_why_it_was_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 40 samples in batches of 16: step 2's batch has 8 rows, so its table differs.
    make_trainer(tmp_path, [ShapeLogger(log_every_n_steps=1)], max_steps=3).fit(TinyNet())
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ShapeLogger: ")]
    assert headers == [
        "ShapeLogger: TinyNet · step 0 · batch 0: [16, 4], 1: [16]",
        "ShapeLogger: TinyNet · step 2 · batch 0: [8, 4], 1: [8] (batch shapes changed from 0: [16, 4], 1: [16])",
    ]
    assert texts(tmp_path, "shapes/train")[2].startswith("**TinyNet · step 2 · batch 0: [8, 4], 1: [8] (batch shapes")


def test_with_a_progress_bar_the_table_starts_on_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Lightning's TQDM bar draws on stdout; printed plainly, the table was glued to it: "...it/s]ShapeLogger: ...".
    # Through the bar, the line is cleared first ("\r", blanks, "\r"), as a terminal shows it.
    bar = TQDMProgressBar()
    make_trainer(tmp_path, [ShapeLogger(), bar], max_steps=2, enable_progress_bar=True).fit(TinyNet())
    out = capsys.readouterr().out
    assert "Epoch 0:" in out  # the bar was drawn
    assert re.search(r"\r *\rShapeLogger: TinyNet · step 0", out)
    assert not re.search(r"[^\r\n]ShapeLogger: ", out)


def test_reused_module_gets_a_row_per_call_in_execution_order(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ShapeLogger()], max_steps=1).fit(TinyNet())
    rows = [line.split(" | ")[0].lstrip("| ") for line in texts(tmp_path, "shapes/train")[0].splitlines()[4:]]
    assert rows == ["root", "fc1", "act", "fc2", "act", "head"]


def test_logs_again_only_for_a_new_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 40 samples in batches of 16: steps 0, 1 see 16 rows, step 2 sees 8; the next epoch repeats.
    make_trainer(tmp_path, [ShapeLogger(log_every_n_steps=1)], max_steps=6).fit(TinyNet())
    logged = texts(tmp_path, "shapes/train")
    assert list(logged) == [0, 2]
    table = logged[2].split("\n\n", 1)[1]  # below the header, which says what changed
    assert "[8, 4]" in table
    assert "[16, 4]" not in table
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


class Tapped(nn.Module):
    """Linear, then a tap that sees the output (twice as wide when ``wide``), then ReLU."""

    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        self.fc, self.tap, self.act, self.wide = nn.Linear(4, 4), nn.Identity(), nn.ReLU(), wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.tap(torch.cat([y, y], dim=-1) if self.wide else y)
        return self.act(y)


class Stack(TinyNet):
    """Seven blocks; block 3 differs from the others in one shape only (its tap's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Tapped(wide=i == 3) for i in range(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.act(self.fc2(self.act(self.fc1(x)))))


def layer_column(table: str) -> list[str]:
    return [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[4:]]


def test_identical_blocks_collapse_but_not_one_that_differs_in_one_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_trainer(tmp_path, [ShapeLogger()], max_steps=1).fit(Stack())
    table = texts(tmp_path, "shapes/train")[0]
    blocks = [name for name in layer_column(table) if name.startswith("blocks")]
    assert blocks == [
        *("blocks.0–2  ×3", "blocks.0–2.fc", "blocks.0–2.tap", "blocks.0–2.act"),
        *("blocks.3", "blocks.3.fc", "blocks.3.tap", "blocks.3.act"),
        *("blocks.4–6  ×3", "blocks.4–6.fc", "blocks.4–6.tap", "blocks.4–6.act"),
    ]
    assert "| blocks.3.tap | Identity | [16, 8] | [16, 8] | 0 |" in table
    assert "| blocks.0–2  ×3 | Tapped | [16, 4] | [16, 4] | 20 |" in table  # one block's parameters
    printed = capsys.readouterr().out
    assert re.search(r"^blocks\.4–6  ×3\s+Tapped\s+\[16, 4\]\s+\[16, 4\]\s+20$", printed, re.MULTILINE)
    assert "blocks.5" not in printed


def test_collapse_repeats_false_shows_every_call(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_trainer(tmp_path, [ShapeLogger(collapse_repeats=False)], max_steps=1).fit(Stack())
    rows = layer_column(texts(tmp_path, "shapes/train")[0])
    assert [name for name in rows if name.startswith("blocks") and name.count(".") == 1] == [
        f"blocks.{i}" for i in range(7)
    ]
    assert len(rows) == 1 + 7 * 4 + 5
    assert "×" not in capsys.readouterr().out


class Heads(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((head(x) for head in self.heads), torch.zeros(()))


class Shared(nn.Module):
    """Blocks that each call one module owned by the parent: its calls sit between theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.shared(block(x))
        return x


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (nn.Sequential(*(nn.Linear(4, 4) for _ in range(3))), ["root", "0–2  ×3"]),
        (nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ["root", "0", "1"]),  # a pair stays as it is
        (nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)), nn.Linear(4, 2)), ["root", "0–3  ×4", "4"]),
        (nn.Sequential(nn.Linear(4, 4, bias=False), *(nn.Linear(4, 4) for _ in range(3))), ["root", "0", "1–3  ×3"]),
        (
            nn.Sequential(*(Heads(4) for _ in range(3))),
            ["root", "0–2  ×3", "0–2.heads.0–3  ×4"],
        ),
        (Shared(), ["root", *(name for i in range(4) for name in (f"blocks.{i}", "shared"))]),
    ],
    ids=["three", "pair", "run-then-other", "other-then-run", "nested", "interleaved"],
)
def test_which_runs_collapse(model: nn.Module, expected: list[str]) -> None:
    rows = trace_shapes(model, torch.zeros(2, 4))
    assert [re.split(r"\s{2,}(?!×)", line)[0] for line in format_table(rows).splitlines()[2:]] == expected
    assert len(format_table(rows, collapse=False).splitlines()) == 2 + len(rows)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def test_a_call_with_many_arguments_keeps_the_printed_row_readable() -> None:
    rows = trace_shapes(Attention(), torch.zeros(16, 10, 8))
    printed = format_table(rows)
    assert max(len(line) for line in printed.splitlines()) <= 120, printed
    cell = next(line for line in printed.splitlines() if line.startswith("attn ")).split("  ")
    assert any(c.endswith("…") for c in cell)  # cut short in the terminal ...
    assert "need_weights: bool" in format_markdown(rows)  # ... whole in the loggers' table

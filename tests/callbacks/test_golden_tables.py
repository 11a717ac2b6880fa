"""The printed shape table, against golden files (regenerate with `pytest --update-golden`)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from examples.encoder import EncoderLM
from examples.numnet import NumDataModule, NumNet
from examples.transformer import TokenDataModule
from lightning_hooks import ShapeLogger
from tests.support.helpers import make_trainer
from tests.support.zoo import ResNetish

GOLDEN = Path(__file__).parents[1] / "support" / "golden"


def printed_table(tmp_path: Path, model: pl.LightningModule, capsys: pytest.CaptureFixture[str], **fit: object) -> str:
    make_trainer(tmp_path, [ShapeLogger()], logger=False, max_steps=1).fit(model, **fit)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    return out[out.index("ShapeLogger:") :]


@pytest.mark.parametrize("name", ["numnet", "resnetish", "encoder24"])
def test_printed_table_matches_golden(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], update_golden: bool, name: str
) -> None:
    torch.manual_seed(0)
    if name == "numnet":
        table = printed_table(tmp_path, NumNet(), capsys, datamodule=NumDataModule())
    elif name == "resnetish":
        table = printed_table(tmp_path, ResNetish(), capsys)
    else:  # 24 identical layers, collapsed into one block: the table fits on a screen
        datamodule = TokenDataModule(seq_len=16, n=16, batch_size=8)
        table = printed_table(tmp_path, EncoderLM(layers=24), capsys, datamodule=datamodule)
        assert len(table.splitlines()) <= 60
    golden = GOLDEN / f"{name}.txt"
    if update_golden:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(table)
    assert golden.exists(), f"{golden} is missing: run `pytest --update-golden` once and review it"
    assert table == golden.read_text()

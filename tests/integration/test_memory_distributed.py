"""MemoryLogger under real 2-process DDP and FSDP2 on CPU (gloo): every rank records, rank zero reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import events, run_script, scalars

pytestmark = pytest.mark.ddp
SCRIPT = Path(__file__).parents[1] / "support" / "memory_run.py"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_records_and_the_summary_names_the_largest_peak(strategy: str, tmp_path: Path) -> None:
    done = run_script(SCRIPT, "--strategy", strategy, "--out", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        assert rank["rows"] > 0, rank
        assert rank["hooks_kept"], rank
    assert ranks[1]["peak"] > ranks[0]["peak"] > 0, "rank 1's batches are twice as large"
    assert done.stdout.count("MemoryLogger: ") == 1, "only rank zero prints"
    largest = ranks[1]["summary"].split("; ")[1]
    assert largest.startswith("largest over 2 ranks"), ranks[1]["summary"]
    assert largest.endswith("on rank 1"), ranks[1]["summary"]
    assert "memory/train" in events(tmp_path / "tb").Tags()["tensors"]
    assert scalars(tmp_path / "tb", "memory/peak_bytes") == {1: float(ranks[0]["peak"])}

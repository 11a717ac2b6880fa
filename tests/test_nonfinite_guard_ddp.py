"""NonFiniteGuard with two real DDP processes on CPU: ranks agree on skipping a step one of them found bad."""

from pathlib import Path

import pytest
import torch

from lightning_hooks import NonFiniteGuard
from tests.helpers import make_trainer
from tests.test_finite_core import Log
from tests.test_nonfinite_guard import ChainNet


@pytest.mark.ddp
def test_a_step_only_one_rank_found_bad_is_skipped_by_both(tmp_path: Path) -> None:
    model = ChainNet(Log(), optimizer="adam")
    model.x[17, 0] = -1.0  # the DistributedSampler deals odd samples to rank 1: its second batch
    # Forward checks only: rank 0 sees nothing itself, yet the all-reduced gradients it would step with are NaN.
    guard = NonFiniteGuard(action="skip_step", check_backward=False)
    make_trainer(tmp_path, [guard], logger=False, strategy="ddp_spawn", devices=2, max_steps=3).fit(model)
    # The weights come back from rank 0.
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())

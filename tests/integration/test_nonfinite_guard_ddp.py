"""NonFiniteGuard with two real DDP processes on CPU: ranks agree on skipping a step one of them found bad."""

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import NonFiniteGuard
from lightning_hooks.callbacks.nonfinite_guard import SKIPPED_TAG, TEXT_TAG
from tests.callbacks.test_nonfinite_guard import ChainNet
from tests.support.helpers import make_trainer, scalars, texts
from tests.unit.test_finite_core import Log


@pytest.mark.ddp
def test_a_step_only_one_rank_found_bad_is_skipped_by_both(tmp_path: Path) -> None:
    model = ChainNet(Log(), optimizer="adam")
    model.x[17, 0] = -1.0  # the DistributedSampler deals odd samples to rank 1: its second batch
    # Forward checks only: rank 0 sees nothing itself, yet the all-reduced gradients it would step with are NaN.
    guard = NonFiniteGuard(action="skip_step", check_backward=False)
    make_trainer(tmp_path, [guard], logger=False, strategy="ddp_spawn", devices=2, max_steps=3).fit(model)
    # The weights come back from rank 0.
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


class RankChain(ChainNet):
    """Rank ``r`` trains on samples ``r, r + 2, r + 4, ...`` in order (no sampler, no shuffling)."""

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        return DataLoader(TensorDataset(self.x[rank::2], self.y[rank::2]), batch_size=self.batch_size)


@pytest.mark.ddp
@pytest.mark.parametrize(
    ("mode", "optimizer"),
    # A fused AdamW is handed the flag: both ranks skip step 1 on the device and report it at step 2.
    [("replay", "adam"), ("eager", "adam"), ("replay", "fused adamw")],
)
def test_a_nan_made_on_rank_1_only_is_reported_by_rank_0_naming_rank_1(
    tmp_path: Path, mode: str, optimizer: str
) -> None:
    model = RankChain(Log(), optimizer=optimizer)
    model.x[17, 0] = -1.0  # rank 1's sample 8: its second batch; rank 0's batches stay finite
    guard = NonFiniteGuard(action="skip_step", mode=mode)
    trainer = make_trainer(
        tmp_path, [guard], strategy="ddp_spawn", devices=2, max_steps=3, use_distributed_sampler=False
    )
    trainer.fit(model)
    reports = texts(tmp_path, TEXT_TAG)  # written by rank 0
    assert sorted(reports) == [1], reports
    assert "forward: `layer3` (Log) made non-finite values from finite inputs" in reports[1]
    assert "step 1, batch 1, rank 1" in reports[1]
    assert "the optimizer step is skipped" in reports[1]
    assert scalars(tmp_path, SKIPPED_TAG) == {1: 1.0}  # both ranks skipped: the weights stayed finite
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())

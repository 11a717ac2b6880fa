"""Real tensor parallelism and HSDP (Lightning's ModelParallelStrategy) on CPU with gloo.

Every value GradStats, ActivationStats and GradClamp log is compared with one process training the same
model, weights and data (the union of the data-parallel ranks' batches): what a user expects the mesh to
leave unchanged. The model's mean pooling makes the gradients of every position alike, so that a shard of
the sequence cannot be told from a replica by its gradient.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_hooks import HealthMonitor
from tests.support.helpers import events, make_trainer, run_script, scalars, texts
from tests.support.tp_run import BATCH, CLAMP, HEALTH_STEPS, MODES, STEPS, TransformerNet, callbacks

pytestmark = pytest.mark.ddp
SCRIPT = Path(__file__).parents[1] / "support" / "tp_run.py"


def run(mode: str, out: Path, *extra: str) -> list[dict]:
    done = run_script(SCRIPT, "--mode", mode, "--out", str(out), *extra, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(ranks) == MODES[mode][0]
    return ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One process per data-parallel size, on the union of that many ranks' batches; value clipping stands in
    for ``GradClamp(mode="accumulated")``."""
    found = {}
    for replicas in sorted({processes // tensor_parallel for processes, tensor_parallel in MODES.values()}):
        root = tmp_path_factory.mktemp(f"single{replicas}")
        trainer = make_trainer(
            root, callbacks(), max_steps=STEPS, gradient_clip_val=CLAMP, gradient_clip_algorithm="value"
        )
        trainer.fit(TransformerNet(batch_size=BATCH * replicas))
        found[replicas] = root
    return found


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_logged_value_equals_one_process(mode: str, tmp_path: Path, reference: dict[int, Path]) -> None:
    ranks = run(mode, tmp_path)
    assert [rank.get("error") for rank in ranks] == [None] * len(ranks), ranks
    processes, tensor_parallel = MODES[mode]
    placements = ranks[0]["placements"]
    if tensor_parallel > 1:  # the projections' weights are split over both mesh dimensions
        assert "Shard(dim=1)" in placements["blocks.0.down.weight"], placements
    single = reference[processes // tensor_parallel]
    expected_tags = set(events(single / "tb").Tags()["scalars"])
    tags = set(events(tmp_path / "tb").Tags()["scalars"])
    assert expected_tags <= tags, sorted(expected_tags - tags)
    checked = 0
    for tag in sorted(expected_tags):
        got, expected = scalars(tmp_path / "tb", tag), scalars(single / "tb", tag)
        assert sorted(got) == sorted(expected) == list(range(STEPS)), tag
        for step in range(STEPS):
            assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-7), (tag, step)
            checked += 1
    assert checked > 300
    if mode == "hsdp":  # NonFiniteGuard, MemoryLogger and HealthMonitor rode along: every rank ran and they agree
        assert all(rank["memory"]["rows"] > 10 for rank in ranks), ranks
        assert all("largest over 4 ranks" in rank["memory"]["summary"] for rank in ranks), ranks
        assert all(rank["findings"] == ranks[0]["findings"] for rank in ranks), ranks
    if mode == "tp2":  # the shape table: a parallelised layer's whole output, and this rank's part of it
        table = texts(tmp_path / "tb", "shapes/train")[0]
        up = next(line for line in table.splitlines() if line.startswith("| blocks.0.up "))
        assert "| [4, 6, 16] | [4, 6, 32] (local [4, 6, 16]) | 544 |" in up, up
        # Between the column- and the row-wise layer the activation is a plain tensor, `up`'s local part: shown whole.
        act = next(line for line in table.splitlines() if line.startswith("| blocks.0.act "))
        assert "| [4, 6, 32] (local [4, 6, 16]) | [4, 6, 32] (local [4, 6, 16]) | 0 |" in act, act
    # Every element clamped counted once: by hand on the union's gradients at step 0.
    model = TransformerNet(batch_size=BATCH * (processes // tensor_parallel))
    model.load_state_dict(torch.load(tmp_path / "initial.pt"))
    x, y = next(iter(model.train_dataloader()))
    model.training_step((x, y), 0).backward()
    grads = [p.grad for p in model.parameters()]
    clamped = sum(int((g.abs() > CLAMP).sum()) for g in grads) / sum(g.numel() for g in grads)
    assert scalars(tmp_path / "tb", "grad_clamp/clamped_fraction")[0] == pytest.approx(clamped)
    # The total norm is torch's of the full gradients (read before the clamp, which comes after GradStats).
    total = float(torch.nn.utils.get_total_norm(grads))
    assert scalars(tmp_path / "tb", "grad_norm_total")[0] == pytest.approx(total, rel=1e-4)


@pytest.mark.parametrize("mode", ["tp2", "dp2-tp2"])
def test_the_backward_clamp_clamps_each_data_parallel_ranks_whole_gradient(mode: str, tmp_path: Path) -> None:
    # Under sequence parallelism (dp2-tp2) a norm's weight gradient is a `Partial` sum while backward runs: it is
    # summed over the tensor-parallel ranks first. Expected: DDP's semantics, by hand in one process.
    ranks = run(mode, tmp_path, "--backward-clamp")
    assert [rank.get("error") for rank in ranks] == [None] * len(ranks), ranks
    processes, tensor_parallel = MODES[mode]
    want, fraction = clamped_by_hand(torch.load(tmp_path / "initial.pt"), processes // tensor_parallel)
    final = torch.load(tmp_path / "final.pt")
    for name, weight in want.items():
        assert torch.allclose(final[name], weight, atol=1e-6), name
    assert scalars(tmp_path / "tb", "grad_clamp/clamped_fraction")[0] == pytest.approx(fraction, rel=1e-5)


def clamped_by_hand(initial: dict[str, torch.Tensor], replicas: int) -> tuple[dict[str, torch.Tensor], float]:
    """``STEPS`` steps in which each data-parallel rank clamps the gradient of its own batch, the ranks' gradients
    are averaged and SGD(lr=0.1) steps; and the clamped share of the ranks' gradients at step 0."""
    model = TransformerNet(batch_size=BATCH)
    model.load_state_dict(initial)
    data = TensorDataset(model.x, model.y)
    loaders = [
        iter(DataLoader(data, BATCH, sampler=DistributedSampler(data, replicas, rank, shuffle=False)))
        for rank in range(replicas)
    ]
    clamped = seen = 0
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for loader in loaders:
            model.zero_grad()
            model.training_step(next(loader), 0).backward()
            for summed, p in zip(total, model.parameters(), strict=True):
                assert p.grad is not None
                if step == 0:
                    clamped, seen = clamped + int((p.grad.abs() > CLAMP).sum()), seen + p.grad.numel()
                summed += p.grad.clamp(-CLAMP, CLAMP) / replicas
        with torch.no_grad():
            for summed, p in zip(total, model.parameters(), strict=True):
                p -= 0.1 * summed
    return model.state_dict(), clamped / seen


def test_the_guard_names_the_rank_and_layer_where_values_went_wrong_and_memory_is_recorded_per_rank(
    tmp_path: Path,
) -> None:
    # dp2-tp2: FSDP2 gathers rank 1's poisoned shard of `up` into ranks 1 and 3 (the same tensor-parallel place).
    ranks = run("dp2-tp2", tmp_path, "--guard")
    for rank in ranks:
        assert "error" not in rank, rank
        # Rank 0's first NaN is in `down`'s output (the shards summed), but rank 1's `up` made it, earlier.
        assert rank["finding"][0].startswith("forward: `blocks.0.up` (Linear) made non-finite values"), rank
        assert rank["finding"][-1] == "step 1, batch 1, rank 1", rank
        assert rank["replayed"] is True, "the failed step was replayed: no hooks on the steps before it"
        assert rank["memory"]["rows"] > 10, rank
        assert "largest over 4 ranks" in rank["memory"]["summary"], rank


def test_health_monitor_judges_units_split_between_ranks_as_one_process_does(tmp_path: Path) -> None:
    ranks = run("tp2", tmp_path, "--health")
    model = TransformerNet(dead=True)
    monitor = HealthMonitor(log_every_n_steps=1)
    make_trainer(tmp_path / "single", [monitor], max_steps=HEALTH_STEPS).fit(model)
    expected = [(f.check, list(f.layers), f.step, pytest.approx(f.value, rel=1e-4)) for f in monitor.findings]
    # 24 of the first MLP's 32 units are dead, 0.75, over the 0.7 line: rank 0 alone holds 8 of its 16 (0.5, below).
    assert ("dead_units", ["blocks.0.act"]) in [(check, layers) for check, layers, _, _ in expected]
    for rank in ranks:
        assert "error" not in rank, rank
        assert [tuple(f) for f in rank["findings"]] == [tuple(f) for f in expected], rank["findings"]

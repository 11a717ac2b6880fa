"""Real 2-process FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard``) on CPU with gloo.

Every figure is compared with one process training the same model on the union of the two
ranks' batches: what a user expects sharding to leave unchanged.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_hooks import ActivationStats, GradStats
from tests.integration.test_ddp import expected_weights
from tests.support.fsdp_run import CLAMP, STEPS
from tests.support.helpers import TinyNet, events, make_trainer, run_script, scalars

pytestmark = pytest.mark.ddp
SCRIPT = Path(__file__).parents[1] / "support" / "fsdp_run.py"
PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias")


def run(mode: str, out: Path, timeout: float = 90) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    done = run_script(SCRIPT, "--mode", mode, "--out", str(out), timeout=timeout)
    ranks = sorted(out.glob("rank*.json"))
    return done, [json.loads(p.read_text()) for p in ranks]


@pytest.fixture(scope="module")
def sharded_fit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("fsdp")
    done, ranks = run("fit", out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(ranks) == 2
    for rank in ranks:
        assert "error" not in rank, rank
        assert set(PARAMS) <= set(rank["sharded"]), "every parameter is a DTensor"
    return out, done.stdout


def union_model(out: Path) -> TinyNet:
    """The same model in one process, its batches the two ranks' batches of each step side by side."""
    model = TinyNet(batch_size=16)
    model.load_state_dict(torch.load(out / "initial.pt"))
    ranks = [torch.load(out / f"batches_rank{rank}.pt") for rank in range(2)]
    model.x = torch.cat([torch.cat([r[step][0] for r in ranks]) for step in range(STEPS)])
    model.y = torch.cat([torch.cat([r[step][1] for r in ranks]) for step in range(STEPS)])
    return model


@pytest.fixture(scope="module")
def single(sharded_fit: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TinyNet]:
    """The reference: one process, Lightning's own value clipping in place of GradClamp(mode="accumulated")."""
    out, _ = sharded_fit
    root = tmp_path_factory.mktemp("single")
    model = union_model(out)
    callbacks = [GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)]
    trainer = make_trainer(root, callbacks, max_steps=STEPS, gradient_clip_val=CLAMP, gradient_clip_algorithm="value")
    trainer.fit(model)
    return root, model


def assert_same(sharded: Path, reference: Path, tags: list[str]) -> None:
    """Every step of every tag logged by the sharded run equals the single process's within rel=1e-5."""
    for tag in tags:
        got, expected = scalars(sharded / "tb", tag), scalars(reference / "tb", tag)
        assert sorted(got) == list(range(STEPS)), tag  # step 0 and after a few steps
        for step in range(STEPS):
            # A mean that cancels to ~1e-10 (the head's weight under softmax) is float32 noise: abs=1e-8 for it.
            assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-8), (tag, step)


def test_gradient_statistics_equal_one_process_on_the_union(
    sharded_fit: tuple[Path, str], single: tuple[Path, TinyNet]
) -> None:
    stats = ("grad_norm", "grad_mean", "grad_std", "grad_abs_max", "grad_zero_frac", "grad_nonfinite", "update_ratio")
    tags = ["grad_norm_total", *(f"{stat}/{p}" for p in PARAMS for stat in stats)]
    assert_same(sharded_fit[0], single[0], tags)


def test_activation_statistics_equal_one_process_on_the_union(
    sharded_fit: tuple[Path, str], single: tuple[Path, TinyNet]
) -> None:
    stats = ("act_mean", "act_std", "act_abs_max", "act_zero_frac")
    assert_same(
        sharded_fit[0], single[0], [f"{stat}/{layer}" for layer in ("fc1", "fc2", "head", "act") for stat in stats]
    )


def test_output_gradient_statistics_equal_one_process_on_the_union(
    sharded_fit: tuple[Path, str], single: tuple[Path, TinyNet]
) -> None:
    # Each rank's are of its own batch's mean loss; the fit minimises the mean over ranks, as one process does.
    layers = ("fc1", "fc2", "head", "act")
    assert_same(sharded_fit[0], single[0], [f"out_grad_{s}/{layer}" for layer in layers for s in ("norm", "abs_max")])


def test_accumulated_clamp_of_shards_equals_value_clipping(
    sharded_fit: tuple[Path, str], single: tuple[Path, TinyNet]
) -> None:
    out, _ = sharded_fit
    _, reference = single
    final = torch.load(out / "final.pt")
    for name, param in reference.named_parameters():
        assert torch.allclose(final[name], param.detach(), atol=1e-6), name
    # The clamped share counts every rank's shard: by hand on the first union batch.
    model = union_model(out)
    x, y = model.x[:16], model.y[:16]
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(PARAMS)
    expected = sum(int((g.abs() > CLAMP).sum()) for g in grads) / sum(g.numel() for g in grads)
    assert 0 < expected < 1
    assert scalars(out / "tb", "grad_clamp/clamped_fraction")[0] == pytest.approx(expected)


def test_backward_clamp_clamps_each_ranks_unsharded_gradient_before_the_reduce_scatter(tmp_path: Path) -> None:
    done, ranks = run("backward", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in ranks:
        assert "error" not in rank, rank
        assert rank["unsharded_hooks_in_step"] == len(PARAMS), "the clamp was on every unsharded parameter"
        assert rank["hooks_kept"] is True
    # By hand, as under DDP: each rank clamps the gradient of its own batch, the ranks average, SGD(lr=0.1) steps.
    final = torch.load(tmp_path / "final.pt")
    for name, tensor in expected_weights(tmp_path, CLAMP).items():
        if name in final:
            assert torch.allclose(final[name], tensor, atol=1e-6), name
    # The clamp changed the training: not the weights without it.
    assert not torch.allclose(final["fc1.weight"], expected_weights(tmp_path, 1e9)["fc1.weight"], atol=1e-4)


def test_one_event_file_clean_names_and_no_hook_left(sharded_fit: tuple[Path, str]) -> None:
    out, stdout = sharded_fit
    assert len(list(out.rglob("events.out.tfevents.*"))) == 1, "only rank zero writes"
    for rank in range(2):
        assert json.loads((out / f"rank{rank}.json").read_text())["hooks_kept"] is True, rank
    assert stdout.count("ShapeLogger:") == 2, "rank zero prints the step-0 table and the smaller last batch's"
    assert "FSDP" not in stdout, "names and types as the user wrote them"
    assert "fc1    Linear" in stdout
    tags = set(events(out / "tb").Tags()["scalars"])
    assert {f"grad_norm/{p}" for p in PARAMS} <= tags
    assert not any("_fsdp" in tag or "FSDP" in tag for tag in tags)


def test_a_rank_that_raises_leaves_no_hook_and_no_hung_process(tmp_path: Path) -> None:
    # Rank 0 goes on into FSDP's all-gather and gives up after the strategy's 20 s timeout.
    done, ranks = run("fail", tmp_path, timeout=75)
    assert len(ranks) == 2, done.stdout[-2000:] + done.stderr[-2000:]
    for rank in ranks:
        assert "error" in rank
        assert rank["hooks_kept"] is True
    assert "planned failure on rank 1" in ranks[1]["error"]
    assert "planned failure" not in ranks[0]["error"], "rank 0 failed on its own, waiting for rank 1"


def test_nonfinite_guard_reads_each_ranks_gradient_shard_and_the_ranks_agree(tmp_path: Path) -> None:
    done, ranks = run("nan", tmp_path)
    assert len(ranks) == 2, done.stdout[-2000:] + done.stderr[-2000:]
    for rank in ranks:
        assert rank["error"].startswith("NonFiniteError: `NonFiniteGuard` found NaN/Inf values at step 1"), rank
        assert rank["hooks_kept"] is True
    for rank in ranks:  # the ranks agree on rank 1's finding, which names the shard's parameter
        assert "`fc2.weight`" in rank["error"]
        assert rank["error"].endswith("step 1, rank 1")


def test_no_callback_refuses_tensor_parallelism_and_every_hook_goes(tmp_path: Path) -> None:
    # Its exactness is tests/integration/test_tensor_parallel.py's; here every callback at once, tp=2, no refusal.
    done, ranks = run("tensor-parallel", tmp_path)
    assert len(ranks) == 2, done.stdout[-2000:] + done.stderr[-2000:]
    for rank in ranks:
        assert "error" not in rank, rank
        assert rank["hooks_kept"] is True, "every hook removed after the fit"


def test_health_monitor_runs_on_every_rank_and_rank_zero_reports(sharded_fit: tuple[Path, str]) -> None:
    out, stdout = sharded_fit
    assert stdout.count("HealthMonitor: no problems found in 3 steps.") == 1
    assert sorted(scalars(out / "tb", "health/update_ratio")) == [0, 1, 2]


def test_health_monitor_pools_a_sharded_layers_update_ratio(tmp_path: Path) -> None:
    # fc2 learns 100x faster: its update ratio, pooled from both ranks' shards of Δw and w, leaves the band.
    done, ranks = run("health", tmp_path)
    assert len(ranks) == 2, done.stdout[-2000:] + done.stderr[-2000:]
    for rank in ranks:
        assert "error" not in rank, rank
        assert rank["findings"] == [["update_ratio", ["fc2"]]]
        assert rank["hooks_kept"] is True
    assert done.stdout.count("HealthMonitor: 1 problem(s) found in 6 steps") == 1

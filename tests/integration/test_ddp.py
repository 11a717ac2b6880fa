"""Real 2-process DDP on CPU with gloo, for both launchers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_hooks import ActivationStats, GradStats, HealthMonitor
from tests.support.helpers import TinyNet, events, make_trainer, run_script, scalars

pytestmark = pytest.mark.ddp
SCRIPT = Path(__file__).parents[1] / "support" / "ddp_run.py"
OUT_GRAD_TAGS = ("out_grad_norm/fc1", "out_grad_norm/head", "out_grad_abs_max/fc2", "out_grad_abs_max/act")


def run(strategy: str, out: Path, *extra: str) -> str:
    done = run_script(SCRIPT, "--strategy", strategy, "--out", str(out), *extra, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def expected_weights(out: Path, value: float) -> dict[str, torch.Tensor]:
    """Each rank clamps the gradient of its own batch, DDP averages, SGD(lr=0.1) steps."""
    model = TinyNet()
    model.load_state_dict(torch.load(out / "initial.pt"))
    batches = [torch.load(out / f"batches_rank{rank}.pt") for rank in range(2)]
    for step in range(len(batches[0])):
        grads = []
        for rank in range(2):
            x, y = batches[rank][step]
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clamp(-value, value) for p in model.parameters() if p.grad is not None])
        with torch.no_grad():
            params = [p for p in model.parameters() if p.grad is not None]
            for param, g0, g1 in zip(params, *grads, strict=True):
                param -= 0.1 * (g0 + g1) / 2
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_all_callbacks_under_ddp(strategy: str, tmp_path: Path) -> None:
    stdout = run(strategy, tmp_path)
    assert stdout.count("ShapeLogger:") == 1, "only rank zero prints, once"
    assert "[8, 4]" in stdout
    assert len({p.parent for p in tmp_path.rglob("events.out.tfevents.*")}) == 1, "only rank zero writes events"
    result = json.loads((tmp_path / "result.json").read_text())
    if strategy == "ddp":
        assert result["pickled_during_fit"]
    # GradClamp ran on every rank, before the all-reduce.
    final = torch.load(tmp_path / "final.pt")
    expected = expected_weights(tmp_path, 0.05)
    for name, tensor in expected.items():
        assert torch.allclose(final[name], tensor, atol=1e-6), name
    # Activation statistics are those of the global batch: compare with one process on the union.
    union = TinyNet(batch_size=16)
    union.load_state_dict(torch.load(tmp_path / "initial.pt"))
    first = [torch.load(tmp_path / f"batches_rank{rank}.pt")[0] for rank in range(2)]
    union.x, union.y = torch.cat([x for x, _ in first]), torch.cat([y for _, y in first])
    single = [ActivationStats(log_every_n_steps=1), GradStats(log_every_n_steps=1)]
    make_trainer(tmp_path / "single", single, max_steps=1).fit(union)
    # Output gradients too: each rank's are of its own loss, and training minimises the ranks' mean loss.
    for tag in ("act_mean/fc1", "act_std/fc1", "act_abs_max/head", "act_zero_frac/act", *OUT_GRAD_TAGS):
        ddp_value = scalars(tmp_path / "tb", tag)[0]
        assert ddp_value == pytest.approx(scalars(tmp_path / "single", tag)[0], rel=1e-5), tag
    tags = events(tmp_path / "tb").Tags()
    assert {"grad_norm/fc1.weight", "out_grad_norm/fc1", "grad_clamp/clamped_fraction"} <= set(tags["scalars"])
    assert "shapes/train" in tags["tensors"]


def test_ranks_with_different_batch_shapes_do_not_deadlock(tmp_path: Path) -> None:
    run("ddp", tmp_path, "--uneven")
    mean = scalars(tmp_path / "tb", "act_mean/fc1")
    assert sorted(mean) == [0, 1]


@pytest.mark.parametrize("functional", [False, True], ids=["nn.ReLU", "torch.relu"])
def test_health_monitor_decides_on_rank_zero_from_the_pooled_statistics(tmp_path: Path, functional: bool) -> None:
    """Each rank alone has half the ReLU's units dead for its whole batch; pooled over both, none is. A ReLU applied
    in forward has its units counted where the next layer takes them, pooled the same way."""
    stdout = run("ddp", tmp_path, "--health", *(["--functional"] if functional else []))
    assert stdout.count("HealthMonitor: no problems found in 64 steps.") == 1  # rank zero prints, once
    assert scalars(tmp_path / "tb", "health/dead_units") == dict.fromkeys(range(64), 0.0)
    # What rank zero would have said from its own batches alone:
    from tests.support.ddp_run import HalfDeadFunctional, HalfDeadOnEachRank

    alone = (HalfDeadFunctional if functional else HalfDeadOnEachRank)(batch_size=8)
    alone.load_state_dict(torch.load(tmp_path / "initial.pt"))
    alone.train_dataloader = lambda: torch.utils.data.DataLoader(  # type: ignore[method-assign]
        torch.utils.data.TensorDataset(-alone.x.abs(), alone.y), batch_size=8
    )
    monitor = HealthMonitor(log_every_n_steps=1, checks=["dead_units"], exclude=["unused"], dead_fraction=0.5)
    make_trainer(tmp_path / "alone", [monitor], max_steps=64).fit(alone)  # a window of 512 samples per unit
    layer = "fc1" if functional else "act"
    assert [(f.check, f.layers, f.value) for f in monitor.findings] == [("dead_units", (layer,), 0.5)]

"""torch.compile in the setups users train with every day: gradient accumulation, DDP, bf16 autocast.

Each test fits the same tiny model with ``Body`` compiled and eager (same seed, same data) and
reads back what each fit wrote; the models and callbacks are those of ``tests/integration/test_compile.py``,
so that in a full run inductor's cache already holds most graphs these fits compile.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from lightning_hooks import GradClamp, NonFiniteError, NonFiniteGuard, ShapeLogger
from tests.callbacks.test_nonfinite_guard import ChainNet
from tests.integration.test_compile import Body, CompiledBody, fit, statistics
from tests.support.helpers import events, hook_state, make_trainer, scalars, texts
from tests.unit.test_finite_core import Log

COMPILED_LAYERS = ("body", "body.fc1", "body.fc2", "body.act", "body.last")


def assert_same_scalars(eager: Path, compiled: Path, steps: list[int], rel: float = 1e-5) -> list[str]:
    """Every scalar tag the eager fit wrote, written by the compiled fit at ``steps`` with the same values."""
    tags = sorted(events(eager).Tags()["scalars"])
    assert sorted(events(compiled).Tags()["scalars"]) == tags
    for tag in tags:
        want, got = scalars(eager, tag), scalars(compiled, tag)
        assert sorted(got) == steps, tag
        assert got == pytest.approx(want, rel=rel, abs=1e-7), tag
    return tags


def test_accumulated_steps_report_what_eager_reports(tmp_path: Path) -> None:
    # 3 batches an epoch: step 0 is batches 0 and 1, step 2 batches 0 and 1 of the second epoch; each logging
    # step pools two micro-batches, which run the logging graph, and the quiet ones run the quiet graph.
    # ShapeLogger records the first micro-batch of each logging step, inside the same logging graph.
    common: dict[str, Any] = {"accumulate_grad_batches": 2, "max_steps": 3}
    eager = fit(tmp_path / "eager", CompiledBody(compiled=False), [*statistics(), ShapeLogger(2)], **common)
    compiled = fit(tmp_path / "compiled", CompiledBody(), [*statistics(), ShapeLogger(2)], **common)
    tags = assert_same_scalars(eager.root, compiled.root, [0, 2])
    shapes = texts(compiled.root, "shapes/train")
    assert shapes == texts(eager.root, "shapes/train")
    assert len(shapes) == 1  # the same table at steps 0 and 2, logged once
    assert shapes[0].count("| body.act | ReLU | [16, 8] | [16, 8] |") == 2
    for group in ("act_mean/", "act_std/", "out_grad_norm/", "grad_norm/", "update_ratio/"):
        assert [t for t in tags if t.startswith(group + "body.fc1")], group
    want, got = events(eager.root).Histograms("act/body.act"), events(compiled.root).Histograms("act/body.act")
    # 16 rows x 8 units, 2 calls of `act` a forward, 2 micro-batches
    assert [h.histogram_value.num for h in got] == [h.histogram_value.num for h in want] == [512.0] * 2
    assert (compiled.graphs, compiled.breaks) == (2, 0)  # quiet and logging, whatever the micro-batch
    assert not [w for w in compiled.caught if "never ran" in w or "recompile" in w]


@pytest.mark.parametrize("mode", ["backward", "accumulated"])
def test_grad_clamp_under_accumulation_trains_as_eager(tmp_path: Path, mode: Any) -> None:
    common: dict[str, Any] = {"logger": False, "accumulate_grad_batches": 2, "max_steps": 3}
    eager = fit(
        tmp_path / "eager", CompiledBody(compiled=False), [GradClamp(0.01, mode=mode), NonFiniteGuard()], **common
    )
    compiled = fit(tmp_path / "compiled", CompiledBody(), [GradClamp(0.01, mode=mode), NonFiniteGuard()], **common)
    free = fit(tmp_path / "free", CompiledBody(compiled=False), [], **common)
    for (name, want), got in zip(eager.model.named_parameters(), compiled.model.parameters(), strict=True):
        assert torch.allclose(got, want, atol=1e-6), name
    assert not all(torch.allclose(a, b) for a, b in zip(eager.model.parameters(), free.model.parameters(), strict=True))
    assert compiled.breaks == 0


class CompiledChain(ChainNet):
    """ChainNet with ``fc1 → act → log`` compiled as ``body``: the -1 planted in a batch makes a NaN in ``body.log``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(Log(), **kwargs)
        chain = OrderedDict(fc1=self.fc1, act=self.act, log=self.layer3)
        del self.fc1, self.act, self.layer3
        self.body = torch.compile(nn.Sequential(chain))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("mode", ["replay", "eager"])
def test_nonfinite_guard_names_the_micro_batch_and_layer_inside_a_compiled_region(tmp_path: Path, mode: Any) -> None:
    model = CompiledChain(bad_batches=(3,))  # the second micro-batch of step 1
    before = hook_state(model)
    counters.clear()
    with pytest.raises(NonFiniteError, match=r"forward: `body\.log` \(Log\)") as raised:
        make_trainer(tmp_path, [NonFiniteGuard(mode=mode)], logger=False, accumulate_grad_batches=2).fit(model)
    finding = raised.value.finding
    assert finding is not None
    assert (finding.phase, finding.module, finding.made_here) == ("forward", "body.log", True)
    assert (finding.step, finding.batch_idx, finding.replayed) == (1, 3, mode == "replay")
    message = str(raised.value)
    assert "`body.fc1.weight`" in message
    assert "_orig_mod" not in message
    assert not counters["graph_break"]
    assert hook_state(model) == before


def test_bf16_autocast_reports_what_eager_reports(tmp_path: Path) -> None:
    common: dict[str, Any] = {"precision": "bf16-mixed", "max_steps": 3}
    eager = fit(tmp_path / "eager", CompiledBody(compiled=False), statistics(), **common)
    compiled = fit(tmp_path / "compiled", CompiledBody(), statistics(), **common)
    tags = assert_same_scalars(eager.root, compiled.root, [0, 2], rel=1e-2)  # bit-equal here; other CPUs may round
    assert {"act_mean/body.fc1", "out_grad_norm/body.fc1", "grad_norm/body.fc1.weight"} <= set(tags)
    assert (compiled.graphs, compiled.breaks) == (2, 0)
    assert not [w for w in compiled.caught if "never ran" in w]


class Twins(CompiledBody):
    """The compiled ``body`` and an eager ``twin`` with the same weights, each under its own head (``head``,
    ``twin_head``). The loss is the sum of both heads' losses: each half trains as it would alone, so one DDP fit
    holds the eager run to compare with (a second DDP fit would double the test's time)."""

    def __init__(self) -> None:
        super().__init__(n=64)  # 2 batches of 16 on each rank: the shape the other tests compile for
        torch.manual_seed(0)  # as ``body`` was made
        self.twin, self.twin_head = Body(), copy.deepcopy(self.head)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.body(x)), self.twin_head(self.twin(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        compiled, eager = self(x)
        return F.cross_entropy(compiled, y) + F.cross_entropy(eager, y)


@pytest.mark.ddp
def test_ddp_with_accumulation_reports_every_compiled_layer_as_eager_ddp_does(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = Twins()
    assert all(torch.equal(a, b) for a, b in zip(model.body.parameters(), model.twin.parameters(), strict=True))
    initial = copy.deepcopy(model.body.state_dict())
    callbacks = [*statistics(), GradClamp(0.01), ShapeLogger(2)]
    # `ddp_fork`: the processes inherit the imports and inductor's in-memory caches of this one (inductor resets its
    # compile workers after a fork): 6 s, where `ddp_spawn` takes 20-35 s on the 2-core VM.
    # tests/integration/test_ddp.py covers the `ddp` and `ddp_spawn` launchers; the callbacks do not depend on
    # how the processes started.
    trainer = make_trainer(tmp_path, callbacks, strategy="ddp_fork", devices=2, max_steps=3, accumulate_grad_batches=2)
    trainer.fit(model)
    for (name, compiled), eager in zip(model.body.named_parameters(), model.twin.parameters(), strict=True):
        assert torch.allclose(compiled, eager, atol=1e-6), name  # clamped on each rank, all-reduced, stepped alike
        assert not torch.allclose(compiled, initial[name]), name  # trained: rank 0's weights came back
    assert "never ran" not in capfd.readouterr().err  # rank 0 warns in its own process
    tags = events(tmp_path).Tags()["scalars"]
    twin_tags = [t for t in tags if "/twin" in t]
    for layer in (*COMPILED_LAYERS, "head"):
        for stat in ("act_mean", "act_std", "out_grad_norm", "out_grad_abs_max"):
            assert f"{stat}/{layer.replace('body', 'twin').replace('head', 'twin_head')}" in twin_tags
    assert len(twin_tags) > 50
    shapes = texts(tmp_path, "shapes/train")  # rank zero's, the compiled body recorded inside its logging graph
    assert len(shapes) == 1
    for row in ("fc1 | Linear | [16, 4] | [16, 8] |", "act | ReLU | [16, 8] | [16, 8] |"):
        assert shapes[0].count(f"| body.{row}") == shapes[0].count(f"| twin.{row}") >= 1, row
    for eager_tag in twin_tags:
        tag = eager_tag.replace("/twin_head", "/head").replace("/twin", "/body")
        want, got = scalars(tmp_path, eager_tag), scalars(tmp_path, tag)
        assert sorted(got) == [0, 2], tag
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), tag

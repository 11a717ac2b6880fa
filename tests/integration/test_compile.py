"""torch.compile: compiled regions are observed with no dynamo setting, no graph break and two graphs per region."""

from __future__ import annotations

import gc
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from lightning_hooks import (
    ActivationStats,
    GradClamp,
    GradStats,
    MemoryLogger,
    NonFiniteError,
    NonFiniteGuard,
    ShapeLogger,
)
from lightning_hooks.recorders.gradients import _READERS
from lightning_hooks.stats.state import CHUNK
from tests.support.helpers import CUDA, Probe, TinyNet, events, hook_state, make_trainer, scalars, texts
from tests.support.pretrained import third_party

N = 48
"""Three full batches of 16: one input shape, so each variant of a region is compiled once."""

COMPARED = (
    "act_mean/body.fc1",
    "act_std/body.fc2",
    "act_zero_frac/body.act",  # called twice: both calls pooled
    "act_abs_max/body",
    "act_mean/head",
    "out_grad_norm/body.fc1",
    "out_grad_norm/body.act",
    "out_grad_abs_max/body",
    "grad_norm/body.fc1.weight",
)


class Body(nn.Module):
    """Two layers and a ReLU module called after each."""

    def __init__(self, last: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(4, 8), nn.Linear(8, 8), nn.ReLU()
        self.last = last or nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.act(self.fc2(self.act(self.fc1(x)))))


class CompiledBody(TinyNet):
    """``self.body = torch.compile(Body())`` in ``__init__``, followed by an eager head."""

    def __init__(self, compiled: bool = True, last: nn.Module | None = None, n: int = N) -> None:
        super().__init__(n=n)
        del self.fc1, self.fc2, self.act, self.unused
        torch.manual_seed(0)
        body = Body(last)
        self.body = torch.compile(body) if compiled else body
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Whole(TinyNet):
    """TinyNet with every module in use, for ``trainer.fit(torch.compile(model))``."""

    def __init__(self) -> None:
        super().__init__(n=N)
        del self.unused


def statistics() -> list[Any]:
    """The statistics callbacks, logging every 2 steps: a region's logging graph computes all their statistics."""
    return [ActivationStats(log_every_n_steps=2, histograms=True), GradStats(log_every_n_steps=2)]


def observers() -> list[Any]:
    # ShapeLogger records step 0 only (its period is longer than the fit), so later logging
    # steps run the compiled logging graph.
    return [*statistics(), ShapeLogger(log_every_n_steps=100)]


def warm_up(model: CompiledBody) -> None:
    """A forward and backward before any fit: the region's graphs are cached without hooks."""
    model(model.x[:16]).sum().backward()
    model.zero_grad(set_to_none=True)


@dataclass
class Run:
    root: Path
    model: CompiledBody
    graphs: int = 0
    breaks: int = 0
    caught: list[str] = field(default_factory=list)


def fit(root: Path, model: Any, callbacks: list[Any], **kwargs: Any) -> Run:
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(root, callbacks, **kwargs).fit(model)
    return Run(
        root,
        model,
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        [str(w.message) for w in caught],
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("compile")
    eager = fit(root / "eager", CompiledBody(compiled=False), observers())
    model = CompiledBody()
    warm_up(model)
    entry = model.body.__dict__["forward"]
    hooks = Probe("on_train_end", lambda trainer, pl_module: [weakref.ref(h) for h in forward_hooks(pl_module)])
    compiled = fit(root / "compiled", model, [*observers(), hooks])
    return {"eager": eager, "compiled": compiled, "entry": entry, "hooks": hook_state(model), "refs": hooks.seen[0]}


def forward_hooks(model: nn.Module) -> list[Any]:
    return [hook for module in model.modules() for hook in module._forward_hooks.values()]


def test_compiled_region_reports_what_eager_reports(runs: dict[str, Any]) -> None:
    eager, compiled = runs["eager"], runs["compiled"]
    for tag in COMPARED:
        want, got = scalars(eager.root, tag), scalars(compiled.root, tag)
        assert sorted(got) == [0, 2, 4], tag
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), tag
    want, got = events(eager.root).Histograms("act/body.act"), events(compiled.root).Histograms("act/body.act")
    assert [h.histogram_value.num for h in got] == [h.histogram_value.num for h in want] == [256.0] * 3
    assert [h.histogram_value.max for h in got] == pytest.approx([h.histogram_value.max for h in want], rel=1e-6)
    assert not [t for t in events(compiled.root).Tags()["scalars"] if "_orig_mod" in t]
    assert "| body.fc1 | Linear | [16, 4] | [16, 8] |" in texts(compiled.root, "shapes/train")[0]
    assert not [w for w in compiled.caught if "never ran" in w or "recompile" in w]


def test_two_graphs_and_no_graph_break_per_region(runs: dict[str, Any]) -> None:
    # The region had run before the fit: its cached graph (no hooks) is not used, the quiet and the
    # logging graphs are compiled, and nothing breaks a graph, forward or backward.
    assert runs["compiled"].graphs == 2
    assert runs["compiled"].breaks == 0


def test_after_fit_the_region_runs_as_before(runs: dict[str, Any]) -> None:
    model = runs["compiled"].model
    assert set(runs["hooks"].values()) <= {(0,) * 7, (0, 0)}
    assert not _READERS
    assert model.body.__dict__["forward"] is runs["entry"]
    gc.collect()  # the fresh entry point, its compiled graphs and the hooks they inlined are gone with it
    assert len(runs["refs"]) == 3 * 5  # ActivationStats, GradStats, ShapeLogger on body and its 4 modules (not head)
    assert [ref() for ref in runs["refs"]] == [None] * len(runs["refs"])
    counters.clear()
    model(model.x[:16]).sum().backward()  # the graph cached before the fit, with no hook in it
    assert counters["stats"]["unique_graphs"] == 0
    model.zero_grad(set_to_none=True)


def test_a_second_fit_on_the_same_compiled_model(runs: dict[str, Any], tmp_path: Path) -> None:
    model = runs["compiled"].model
    second = fit(tmp_path, model, [ActivationStats(log_every_n_steps=1, include=["body.*"])], max_steps=2)
    assert sorted(scalars(tmp_path, "act_mean/body.fc2")) == [0, 1]
    assert second.graphs == 1  # the logging graph only: every step logs
    assert second.breaks == 0
    assert not [w for w in second.caught if "never ran" in w]
    assert model.body.__dict__["forward"] is runs["entry"]


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_grad_clamp_and_nonfinite_guard_train_as_eager(tmp_path: Path) -> None:
    def guarded() -> list[Any]:
        return [GradClamp(0.01), NonFiniteGuard()]

    eager = fit(tmp_path / "eager", CompiledBody(compiled=False), guarded(), logger=False)
    compiled = fit(tmp_path / "compiled", CompiledBody(), guarded(), logger=False)
    for (name, want), got in zip(eager.model.named_parameters(), compiled.model.parameters(), strict=True):
        assert torch.allclose(got, want, atol=1e-6), name
    assert compiled.breaks == 0


@pytest.mark.parametrize("mode", ["replay", "eager"])
def test_nonfinite_guard_names_a_layer_inside_a_compiled_region(tmp_path: Path, mode: Any) -> None:
    model = CompiledBody(last=Log())  # log of zeros after the ReLU: -inf
    with pytest.raises(NonFiniteError, match=r"body\.last") as raised:
        make_trainer(tmp_path, [NonFiniteGuard(mode=mode)], logger=False).fit(model)
    assert raised.value.finding is not None
    assert raised.value.finding.layer == "body.last"
    assert set(hook_state(model).values()) <= {(0,) * 7, (0, 0)}


def test_a_lightning_module_compiled_whole(tmp_path: Path) -> None:
    def callbacks() -> list[Any]:
        return [ActivationStats(log_every_n_steps=2), GradStats(log_every_n_steps=2), ShapeLogger(log_every_n_steps=2)]

    torch.manual_seed(0)
    eager = fit(tmp_path / "eager", Whole(), callbacks())
    torch.manual_seed(0)
    model = Whole()
    compiled = fit(tmp_path / "compiled", torch.compile(model), callbacks())
    for tag in ("act_mean/fc1", "act_zero_frac/act", "act_std/root", "out_grad_norm/fc2", "out_grad_norm/root"):
        want, got = scalars(eager.root, tag), scalars(compiled.root, tag)
        assert sorted(got) == [0, 2, 4], tag
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), tag
    assert (compiled.graphs, compiled.breaks) == (2, 0)
    assert not [w for w in compiled.caught if "never ran" in w]
    assert texts(compiled.root, "shapes/train") == texts(eager.root, "shapes/train")
    assert "| fc2 | Linear | [16, 8] | [16, 8] |" in texts(compiled.root, "shapes/train")[0]
    assert set(hook_state(model).values()) <= {(0,) * 7, (0, 0)}


def test_health_monitor_beside_a_compiled_region_says_what_it_leaves_out(tmp_path: Path) -> None:
    from lightning_hooks import HealthMonitor

    model = CompiledBody()
    before = hook_state(model)
    monitor = HealthMonitor(log_every_n_steps=1)
    run = fit(tmp_path, model, [monitor, ActivationStats(log_every_n_steps=2)], max_steps=3)
    told = [m for m in run.caught if "does not count units inside torch.compile'd regions" in m]
    assert len(told) == 1
    assert "body.fc1, body.fc2, body.act" in told[0]
    assert not [m for m in run.caught if "never ran" in m]
    assert scalars(tmp_path, "health/dead_units") == {0: 0.0, 1: 0.0, 2: 0.0}
    assert run.breaks == 0
    assert hook_state(model) == before


@pytest.mark.parametrize(("every", "device"), [(1, "cpu"), (100, "cpu"), pytest.param(100, "cuda", marks=CUDA)])
def test_shape_logger_records_a_compiled_region_without_an_eager_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], every: int, device: str
) -> None:
    # 56 samples in batches of 16: the last batch (8) changes shape. Every step runs the region compiled (an eager
    # step would peak at the eager model's memory), and the tables are the eager fit's, row for row.
    def tables(compiled: bool) -> tuple[list[str], int, Run]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            run = fit(
                tmp_path / str(compiled),
                CompiledBody(compiled=compiled, n=56),
                [ShapeLogger(every)],
                max_steps=8,
                log_every_n_steps=1,
                logger=False,
                accelerator=device,
            )
        calls = len([e for e in profiler.events() if e.name.startswith("Torch-Compiled Region")])
        return capsys.readouterr().out.split("ShapeLogger: ")[1:], calls, run

    eager, _, _ = tables(False)
    compiled, calls, run = tables(True)
    assert len(eager) == 2  # steps 0 and 3 (the batch of 8)
    assert "[8, 4]" not in eager[0]
    assert "body.fc2   Linear        [8, 8]  [8, 8]" in eager[1]
    assert compiled == eager
    assert calls == 8
    assert run.breaks == 0
    assert not [w for w in run.caught if "recompile" in w]


def test_statistics_of_a_region_whose_batch_changes_shape_are_eagers(tmp_path: Path) -> None:
    # 56 samples in batches of 16: the last batch (8) changes shape, and dynamo compiles the logging graph again for
    # it, with the tensors' sizes symbolic. Every step's statistics are the eager fit's.
    def logged(compiled: bool) -> tuple[dict[str, dict[int, float]], Run]:
        run = fit(
            tmp_path / str(compiled),
            CompiledBody(compiled=compiled, n=56),
            [ActivationStats(), GradStats()],
            max_steps=4,
            log_every_n_steps=1,
        )
        return {tag: scalars(run.root, tag) for tag in COMPARED}, run

    eager, _ = logged(False)
    compiled, run = logged(True)
    assert sorted(eager["act_mean/body.fc1"]) == [0, 1, 2, 3]
    for tag in COMPARED:
        assert compiled[tag] == pytest.approx(eager[tag], rel=1e-5, abs=1e-7), tag
    assert run.breaks == 0


class Repeat(nn.Module):
    """Its input repeated into more than ``CHUNK`` values (:class:`Columns` takes the first eight features back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, CHUNK // x.numel() + 1)


def test_an_output_larger_than_a_chunk_is_reduced_whole_inside_the_graph(tmp_path: Path) -> None:
    # Eager code reduces a tensor of more than CHUNK values in pieces; the logging graph reduces it at once.
    def logged(compiled: bool) -> dict[str, dict[int, float]]:
        model = CompiledBody(compiled=compiled, last=nn.Sequential(Repeat(), Columns()))
        run = fit(tmp_path / str(compiled), model, [ActivationStats()], max_steps=1)
        return {stat: scalars(run.root, f"act_{stat}/body.last.0") for stat in ("mean", "std", "abs_max", "zero_frac")}

    eager, compiled = logged(False), logged(True)
    assert eager["zero_frac"][0] > 0.1  # ReLU's zeros, repeated
    for stat, values in eager.items():
        # Inductor's CPU loop adds the 8 M float32 values into fewer partial sums than torch's eager mean does: the
        # means differ by about 2.5e-5.
        assert compiled[stat] == pytest.approx(values, rel=1e-4, abs=1e-7), stat


class Columns(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :8]


class Block(nn.Module):
    """A layer returning ``(hidden, None)``, as transformers' blocks return their optional cache."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc(x), None


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, _ = block(x)
        return x


class Blocks(TinyNet):
    """A compiled stack of :class:`Block` and an eager head."""

    def __init__(self) -> None:
        super().__init__(n=N)
        del self.fc1, self.fc2, self.act, self.unused
        self.stack = torch.compile(Stack())
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(x))


def test_a_nested_output_with_none_breaks_no_graph(tmp_path: Path) -> None:
    # On torch 2.11 (the GPU image's), asking whether None is a dataclass while walking such an output broke the
    # logging graph of GPT-2's blocks inside a generator, so that dynamo skipped their frame and ran it eagerly.
    run = fit(tmp_path, Blocks(), [ActivationStats(log_every_n_steps=1)], max_steps=2)
    assert run.breaks == 0
    assert sorted(scalars(tmp_path, "act_mean/stack.blocks.0.out.0")) == [0, 1]


class Checkpointed(nn.Module):
    """``Body`` run under activation checkpointing: backward runs its forward again."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return out


def test_a_region_with_activation_checkpointing_runs_its_quiet_steps_compiled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A recording hook's side effect inside checkpointing breaks the graph, and dynamo falls back to calling the region
    # eagerly. That fallback served every later step (no graph at all in the fit) until the region's entry tested its
    # switch: now the quiet steps get a graph of their own.
    def printed(compiled: bool) -> tuple[list[str], Run]:
        torch._dynamo.reset()
        model = CompiledBody(compiled=compiled)
        model.body = torch.compile(Checkpointed()) if compiled else Checkpointed()
        run = fit(tmp_path / str(compiled), model, [ShapeLogger()], max_steps=4, logger=False)
        return capsys.readouterr().out.split("ShapeLogger: ")[1:], run

    eager, _ = printed(False)
    compiled, run = printed(True)
    assert compiled == eager
    assert run.graphs == 1  # the quiet one


def test_statistics_in_a_region_with_activation_checkpointing_are_eagers(tmp_path: Path) -> None:
    def logged(compiled: bool) -> dict[str, dict[int, float]]:
        torch._dynamo.reset()
        model = CompiledBody(compiled=compiled)
        model.body = torch.compile(Checkpointed()) if compiled else Checkpointed()
        fit(tmp_path / str(compiled), model, statistics(), max_steps=4)
        tags = ["act_mean/body.inner.fc1", "act_zero_frac/body.inner.act", "out_grad_norm/body.inner.fc1"]
        return {tag: scalars(tmp_path / str(compiled), tag) for tag in [*tags, "grad_norm/body.inner.fc1.weight"]}

    want, got = logged(False), logged(True)
    assert [sorted(steps) for steps in want.values()] == [[0, 2]] * 4
    for tag, steps in want.items():
        assert got[tag] == pytest.approx(steps, rel=1e-5, abs=1e-7), tag


def test_shape_logger_in_a_region_run_eagerly_leaves_out_checkpointing_recompute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # NonFiniteGuard(mode="eager") runs every checked step with compiled code forced eager, so the region's shape
    # hooks run as Python, also when backward runs the checkpointed forward again: those calls are not the step's.
    def printed(compiled: bool) -> list[str]:
        model = CompiledBody(compiled=compiled)
        model.body = torch.compile(Checkpointed()) if compiled else Checkpointed()
        fit(tmp_path / str(compiled), model, [NonFiniteGuard(mode="eager"), ShapeLogger(1)], max_steps=3)
        return capsys.readouterr().out.split("ShapeLogger: ")[1:]

    eager = printed(False)
    assert len(eager) == 1  # one table: every step's calls are the same
    assert "body.inner.fc1" in eager[0]
    assert printed(True) == eager


def test_a_compiled_llama_logs_what_the_eager_one_logs_in_two_graphs(tmp_path: Path) -> None:
    # transformers' Llama (rotary embeddings, grouped-query attention, RMSNorm, SiLU-gated MLP) compiled whole: the
    # statistics callbacks and ShapeLogger add the logging graph and no break.
    logged, runs = [], []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        pl_module = third_party("llama")
        if compiled:
            pl_module.net = torch.compile(pl_module.net)
        callbacks = [*statistics(), ShapeLogger()]
        runs.append(fit(tmp_path / str(compiled), pl_module, callbacks, max_steps=4))
        accumulator = events(tmp_path / str(compiled))
        logged.append({t: {e.step: e.value for e in accumulator.Scalars(t)} for t in accumulator.Tags()["scalars"]})
    assert (runs[1].graphs, runs[1].breaks) == (2, 0)
    # Every tag but the output gradients of the modules that return transformers' ModelOutput (`net`, `net.model`):
    # inside a region an output's gradient is read through an identity on the returned tensor, which would give 0
    # for `net`'s logits, consumed by the loss inside `net` (eager reads dL/dlogits). Left out rather than wrong.
    missing = set(logged[0]) - set(logged[1])
    assert {tag.split("/", 1)[1] for tag in missing} == {
        "net.out.loss",
        "net.out.logits",
        "net.model.out.last_hidden_state",
    }
    assert all(tag.startswith("out_grad_") for tag in missing)
    assert set(logged[1]) <= set(logged[0])
    for tag, values in logged[0].items():
        if tag not in missing and "zero_frac" not in tag:  # a gradient of exactly zero in one and 1e-10 in the other
            assert sorted(values) == [0, 2], tag
            assert logged[1][tag] == pytest.approx(values, rel=1e-4, abs=1e-6), tag


def test_memory_logger_says_what_it_cannot_see_inside_a_compiled_module(tmp_path: Path) -> None:
    # torch's ModTracker ignores every module call inside an OptimizedModule (`_is_in_optimized_module()`), so the
    # tracker has no peak for `body`'s layers. The saved tensors still name who keeps what; nothing is "never ran".
    logger = MemoryLogger()
    run = fit(tmp_path / "module", CompiledBody(), [logger], max_steps=3, logger=False)
    said = [w for w in run.caught if "`MemoryLogger`: torch's memory tracker does not follow" in w]
    assert len(said) == 1
    assert "(`body`)" in said[0]
    assert not [w for w in run.caught if "never ran" in w]
    rows = {row.name: row for row in logger.rows}
    assert rows["body.fc1"].activations > 0
    assert rows["body.fc1"].peak == 0
    # The compiled module left out of the table: nothing to say about it.
    run = fit(tmp_path / "excluded", CompiledBody(), [MemoryLogger(exclude=["body*"])], max_steps=3, logger=False)
    assert not [w for w in run.caught if "does not follow" in w]
    # The LightningModule compiled instead: every column, and nothing to say.
    whole = MemoryLogger()
    run = fit(tmp_path / "whole", torch.compile(Whole()), [whole], max_steps=3, logger=False)
    assert not [w for w in run.caught if "MemoryLogger" in w]
    assert [row.name for row in whole.rows if row.peak == 0] == []

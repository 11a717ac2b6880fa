"""HealthMonitor: each check on a planted pathology through a real fit, what it writes, and its rules."""

from __future__ import annotations

import math
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from benchmarks import health as planted
from lightning_hooks import HealthFinding, HealthMonitor, NonFiniteGuard
from lightning_hooks.diagnose.checks import depth_trend
from lightning_hooks.diagnose.health import (
    HealthTracker,
    Snapshot,
    Thresholds,
    dead_units,
    gradient_spread,
)
from lightning_hooks.diagnose.moments import SPIKE_MIN_HISTORY
from lightning_hooks.diagnose.report import summary
from lightning_hooks.stats.state import State
from tests.support.helpers import Probe, TinyNet, hook_state, make_trainer, scalars, texts
from tests.support.zoo import SparseEmbeddingNet


def fit(
    tmp_path: Path, build: Callable[[], pl.LightningModule], steps: int, every: int = 5, **kwargs: object
) -> tuple[HealthMonitor, list[str]]:
    """Fit the model ``build`` makes (seeded) with a monitor; the monitor and the messages of the warnings it gave."""
    pl.seed_everything(0, verbose=False)
    model = build()
    monitor = HealthMonitor(log_every_n_steps=every, **kwargs)  # type: ignore[arg-type]
    trainer = make_trainer(tmp_path, [monitor], max_steps=steps, log_every_n_steps=every)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return monitor, [str(w.message) for w in caught if "`HealthMonitor` found" in str(w.message)]


def only(findings: list[HealthFinding], check: str) -> list[HealthFinding]:
    return [f for f in findings if f.check == check]


def test_dead_units_are_named_in_the_relu_with_one_finding_warned_once_and_logged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monitor, warned = fit(tmp_path, planted.dead_relu, steps=31)
    [dead] = only(monitor.findings, "dead_units")
    assert dead.layers == ("net.1",)
    assert (dead.step, dead.last_step) == (0, 30)  # one finding, held since step 0, advanced to the last check
    assert dead.value == 1.0
    assert dead.threshold == 0.7
    assert "a large negative bias" in dead.message  # every unit silent: its input is never positive
    assert sum("dead_units" in w for w in warned) == 1
    # every unit silent is conclusive: reported at the first check, without waiting for a window of batches
    assert scalars(tmp_path, "health/dead_units") == {s: 1.0 for s in range(0, 31, 5)}
    tables = texts(tmp_path, "health/findings")
    first = min(tables)
    assert first == 0  # logged when the finding appeared, not at every check
    assert "| dead_units | net.1 | 0 | 0 |" in tables[first]
    assert "no problems" not in capsys.readouterr().out


def test_vanishing_gradients_name_the_first_layer_of_a_deep_sigmoid_mlp(tmp_path: Path) -> None:
    monitor, _ = fit(tmp_path, planted.sigmoid_mlp, steps=11)
    vanishing = only(monitor.findings, "vanishing_gradients")
    assert min(vanishing, key=lambda f: f.value).layers[0] == "net.0"
    assert all(f.value <= f.threshold == 1e-3 for f in vanishing)
    assert not only(monitor.findings, "exploding_gradients")  # the large end of the spread is the healthy one


def test_exploding_gradients_are_seen_between_logging_steps_before_the_overflow(tmp_path: Path) -> None:
    monitor, _ = fit(tmp_path, planted.deep_linear, steps=11, every=10)
    [exploding] = only(monitor.findings, "exploding_gradients")
    assert exploding.step < 5
    assert exploding.value >= exploding.threshold == 100
    assert only(monitor.findings, "nonfinite")


def test_update_ratio_names_the_layer_with_a_hundredfold_learning_rate(tmp_path: Path) -> None:
    monitor, _ = fit(tmp_path, planted.fast_layer, steps=21)
    assert [f.layers for f in only(monitor.findings, "update_ratio")] == [("net.2",)]
    assert "is ten times or more its peers'" in only(monitor.findings, "update_ratio")[0].message


def test_activation_growth_names_the_layer_that_grew(tmp_path: Path) -> None:
    monitor, _ = fit(tmp_path, planted.hot_layer, steps=11, checks=["activation_growth"])
    growth = only(monitor.findings, "activation_growth")
    assert growth[0].layers == ("net.2",)
    assert [f.check for f in monitor.findings] == ["activation_growth"] * len(growth)


def test_a_loss_spike_on_a_quiet_step_is_found_at_its_step_and_attributed(tmp_path: Path) -> None:
    monitor, warned = fit(tmp_path, lambda: planted.planted_model("spike", at_step=33), steps=41, every=10)
    [spike] = only(monitor.findings, "loss_spike")
    assert spike.step == 33
    assert spike.layers[0] == "net.2"
    assert spike.value > spike.threshold == 20
    assert scalars(tmp_path, "health/loss_spike")[40] == len(spike.layers)
    assert any("loss_spike" in w for w in warned)


def test_a_loss_spike_on_two_steps_in_a_row_is_one_finding_from_the_first_to_the_last(tmp_path: Path) -> None:
    calls: list[None] = []

    def twice(out: torch.Tensor) -> torch.Tensor:  # at steps 33 and 34 (one forward a step), net.2's output is x1e3
        calls.append(None)  # in value but passes its gradient unchanged: the loss spikes, the weights are not wrecked
        return out + (out * 1e3 - out).detach() if len(calls) <= 2 else out

    model = lambda: planted.Planted(planted.mlp(), tap="2", at_step=33, once=False, effect=twice)  # noqa: E731
    monitor, warned = fit(tmp_path, model, steps=41, every=10)
    [spike] = only(monitor.findings, "loss_spike")
    assert (spike.step, spike.last_step) == (33, 34)
    assert "at step 34" in spike.message  # the message is the latest step's, as its last_step
    assert len([w for w in warned if "loss_spike" in w]) == 1


def test_nonfinite_names_the_first_layer_in_model_order_and_stays_one_finding(tmp_path: Path) -> None:
    monitor, _ = fit(tmp_path, lambda: planted.planted_model("nan", at_step=10), steps=21)
    [nonfinite] = only(monitor.findings, "nonfinite")
    assert nonfinite.layers[0] == "net.2"
    assert nonfinite.step == 10
    assert nonfinite.last_step == 20


def test_nonfinite_names_what_a_nonfinite_guard_in_the_same_trainer_found(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    # a quiet step: the guard skips it, the monitor sees the loss in its ring
    model = planted.planted_model("nan", at_step=7, once=True)
    monitor = HealthMonitor(log_every_n_steps=5)
    guard = NonFiniteGuard(action="skip_step")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(tmp_path, [guard, monitor], max_steps=11, log_every_n_steps=5).fit(model)
    assert guard.last_finding is not None
    assert guard.last_finding.step == 7
    [nonfinite] = only(monitor.findings, "nonfinite")
    assert nonfinite.layers == ("net.2",)
    assert nonfinite.step == 7
    assert "`NonFiniteGuard` found at step 7" in nonfinite.message


def test_a_healthy_fit_finds_nothing_says_so_and_leaves_no_hook(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = TinyNet(n=64)
    before = hook_state(model)
    monitor, warned = fit(tmp_path, lambda: model, steps=12, every=2, exclude=["unused"])
    assert monitor.findings == []
    assert warned == []
    assert "HealthMonitor: no problems found in 12 steps." in capsys.readouterr().out
    assert hook_state(model) == before
    assert set(scalars(tmp_path, "health/nonfinite")) == {0, 2, 4, 6, 8, 10}
    assert "health/findings" not in [t for t in (tmp_path / "tb").rglob("*") if t.is_file()]


class Scaled(torch.nn.Module):
    """Multiplies by ``factor`` and casts to ``dtype``: a parameter-free leaf with half-precision outputs."""

    def __init__(self, factor: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.factor, self.dtype = factor, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.factor).to(self.dtype)


def half_precision_relu() -> planted.Planted:
    """Half of a ReLU's units dead, in float16, on values whose squares do not fit in float16 (above 256)."""
    first = torch.nn.Linear(16, 64)
    with torch.no_grad():
        first.bias[:32].fill_(-10.0)
    net = torch.nn.Sequential(first, Scaled(300.0, torch.float16), torch.nn.ReLU(), Scaled(1 / 300, torch.float32))
    return planted.Planted(torch.nn.Sequential(*net, torch.nn.Linear(64, 4)))


def test_float16_outputs_are_counted_without_overflow(tmp_path: Path) -> None:
    # half the units silent: judged once a window holds 512 samples per unit (8 checks of 64)
    monitor, _ = fit(tmp_path, half_precision_relu, steps=41, checks=["dead_units", "nonfinite"], dead_fraction=0.5)
    assert [(f.check, f.layers, f.value) for f in monitor.findings] == [("dead_units", ("net.2",), 0.5)]


class SharedReLU(torch.nn.Sequential):
    """One ReLU module (``1``) after two layers of different widths, as SegFormer's MLP applies one dropout module
    after both of its layers; the first layer's 64 units are all dead."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8), torch.nn.Linear(8, 4))
        with torch.no_grad():
            self[0].bias.fill_(-10.0)
            self[2].bias.fill_(1.0)  # the second layer's units live on its bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, act, second, head = self
        return head(act(second(act(first(x)))))


def test_a_module_run_on_two_widths_is_judged_on_its_first(tmp_path: Path) -> None:
    # Before: the second width's unit sums were added to the first's, and the fit died of a size mismatch. The ReLU
    # took two layers' outputs: the dead units are named at the layer that fed it them.
    monitor, _ = fit(tmp_path, lambda: planted.Planted(SharedReLU()), steps=6)
    assert [(f.check, f.layers, f.value) for f in monitor.findings] == [("dead_units", ("net.0",), 1.0)]
    assert "of `net.0` after `net.1` were zero" in monitor.findings[0].message


def test_checks_not_asked_for_are_not_run(tmp_path: Path) -> None:
    monitor, _ = fit(tmp_path, planted.dead_relu, steps=16, checks=["vanishing_gradients"])
    assert monitor.findings == []
    assert monitor._ring is None  # no loss ring without loss_spike: quiet steps cost nothing


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"checks": ["dead_unit"]}, ValueError, r"`HealthMonitor` got `checks=\['dead_unit'\]`; `checks` must be"),
        ({"checks": "nonfinite"}, TypeError, r"`checks` must be a list drawn from"),
        ({"log_every_n_steps": 0}, ValueError, r"`log_every_n_steps=0`; `log_every_n_steps` must be a positive"),
        ({"dead_fraction": "half"}, TypeError, r"`dead_fraction='half'`; `dead_fraction` must be a positive finite"),
        ({"dead_fraction": 1.5}, ValueError, r"`dead_fraction` must be in \(0, 1\]"),
        ({"gradient_spread": 0.5}, ValueError, r"`gradient_spread=0.5`; `gradient_spread` must be a number above 1"),
        ({"spike_threshold": math.inf}, ValueError, r"`spike_threshold` must be a positive finite number"),
        ({"update_ratio_low": 1.0}, ValueError, r"`update_ratio_low` must be below `update_ratio_high`"),
        ({"patience": 0}, ValueError, r"`patience=0`; `patience` must be a positive integer\."),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        HealthMonitor(**kwargs)


def snapshot(step: int, **kwargs: object) -> Snapshot:
    return Snapshot(step=step, order=["fc1", "act", "pool", "fc2"], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fired", "expected"),
    [
        ([3.0, 5.0, 1.0, 9.0], []),  # every unit fired for some sample
        ([0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.75]),  # three quarters never fired: over the line
        ([0.0, 5.0, 1.0, 9.0, 0.0, 0.0, 0.0, 1.0], []),  # half: spare width (a healthy moons MLP has as many)
        ([0.0, 0.0, 0.0, 0.0], [1.0]),
    ],
)
def test_dead_units_count_units_not_zeros(fired: list[float], expected: list[float]) -> None:
    act = {"act": State(numel=64), "pool": State(numel=64)}
    found = dead_units(snapshot(3, activations=act, units={"act": fired, "pool": fired}), Thresholds())
    # the pooling layer after the ReLU carries the same dead units on and is not named again
    assert [(e.layers, e.value) for e in found] == [(("act",), v) for v in expected]


def test_one_dead_unit_of_a_narrow_layer_is_chance_at_any_line() -> None:
    act = {"act": State(numel=64), "pool": State(numel=64)}
    fired = [0.0, 5.0, 1.0, 9.0]  # a quarter, at a line of a quarter: one unit of four is chance
    found = dead_units(snapshot(3, activations=act, units={"act": fired, "pool": fired}), Thresholds(0.25))
    assert found == []


def test_a_layer_with_weights_between_two_dead_relus_ends_the_chain() -> None:
    dead = [0.0, 0.0, 3.0, 4.0]
    snap = Snapshot(
        step=3,
        order=["act", "fc", "act2", "pool"],
        activations={name: State(numel=64) for name in ("act", "act2", "pool")},
        units={"act": dead, "act2": dead, "pool": dead},
        leaves_with_params=frozenset({"fc"}),
    )
    assert [e.layers for e in dead_units(snap, Thresholds(dead_fraction=0.5))] == [("act",), ("act2",)]


def test_dead_units_need_enough_samples_per_unit() -> None:
    found = dead_units(snapshot(3, activations={"act": State(numel=4)}, units={"act": [0.0, 1.0]}), Thresholds())
    assert found == []  # two samples per unit: a healthy ReLU is often zero for both


def grads(**means: float) -> dict[str, State]:
    return {name: State(numel=10, abs_sum=10 * mean, sum_sq=10 * mean * mean) for name, mean in means.items()}


def test_a_spread_of_gradients_along_the_depth_is_named_at_its_input_end() -> None:
    vanishing = gradient_spread(snapshot(0, grads=grads(fc1=1e-7, pool=1e-3, fc2=1.0)), Thresholds())
    assert [(e.check, e.layers) for e in vanishing] == [("vanishing_gradients", ("fc1",))]


@pytest.mark.parametrize("step", [1e-2, 0.5])
def test_a_layer_far_above_its_peers_is_not_called_exploding_for_that_alone(step: float) -> None:
    # BART's tied embedding and output layer under SGD: a gradient 1e3 times the median layer's and steps of 1e-2 to
    # 0.2 of its weights, in a run whose loss falls well; the other layers are the slow ones. `fc2`, a thousand
    # times below the median, comes after layers that get the median's gradient: not lost on the way either.
    steps = {"fc1": step, "pool": step * 1e-4, "fc2": step * 1e-8}  # under SGD the ratio follows the gradient
    found = gradient_spread(snapshot(0, grads=grads(fc1=1e4, pool=1.0, fc2=1e-4), ratios=steps), Thresholds())
    assert found == []


@pytest.mark.parametrize(("first", "named"), [(1e-7, True), (1.0, False)], ids=["lost-on-the-way", "reached-before"])
def test_a_layer_far_below_its_peers_is_vanishing_only_if_the_layers_before_it_get_no_more(
    first: float, named: bool
) -> None:
    # under SGD: a gradient that reached `embed` at the median's size was not lost on its way to `query` (an
    # attention's queries and keys get little while it is near uniform); one that reached `embed` as small was
    means = grads(embed=first, query=1e-7, value=1.0, mlp=1.0, head=1.0)
    found = gradient_spread(Snapshot(step=3, order=list(means), grads=means), Thresholds())
    assert (("query",) in [e.layers for e in found if e.check == "vanishing_gradients"]) is named


@pytest.mark.parametrize(
    ("means", "expected"),
    [
        ([1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1], 1e5),  # a tenfold fall a layer toward the input
        ([1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6], 1.0),  # growing toward the input: the other direction
        ([1e-3] * 6, 1.0),  # flat: no trend (and no division by a zero spread)
        ([1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e3], 1.0),  # one outlier at the output end is no trend along the depth
        ([1e-6, 1e-5, 1e-4, 1e-3, 1e-2], 1.0),  # too few layers to tell
    ],
)
def test_depth_trend_is_a_close_fit_of_the_gradients_logarithm_against_depth(
    means: list[float], expected: float
) -> None:
    assert depth_trend(means) == pytest.approx(expected)


@pytest.mark.parametrize(("samples", "kept"), [(1024, 3), (64, 8)])
def test_dead_units_keep_only_the_checks_of_their_window(samples: int, kept: int) -> None:
    # A large model checked with a window of 64 checks held 64 lists of its 100 k unit flags; the window needs only
    # enough checks for 512 samples per unit (and `patience`): three checks of 1,024 tokens, eight of 64 samples.
    tracker = HealthTracker(["dead_units"], Thresholds(dead_fraction=0.25))
    for step in range(0, 200, 10):
        act = State(numel=8 * samples, sum_sq=1.0)
        units = [0.0, 1.0, 2.0, 3.0, 0.0, 5.0, 6.0, 7.0]
        found = tracker.update(snapshot(step, activations={"act": act}, units={"act": units}))
        if step == 10 * (kept - 1):
            assert [(f.check, f.layers, f.step) for f in found] == [("dead_units", ("act",), 0)]
    assert len(tracker._silent["act"]) == kept
    assert [(f.check, f.step, f.last_step) for f in tracker.findings] == [("dead_units", 0, 190)]


def test_a_finding_that_keeps_holding_is_one_finding_whose_last_step_advances() -> None:
    tracker = HealthTracker(["vanishing_gradients"], Thresholds(patience=2))
    sick = grads(fc1=1e-7, pool=1e-3, fc2=1.0)
    assert tracker.update(snapshot(0, grads=sick)) == []  # once is not yet a finding
    [new] = tracker.update(snapshot(5, grads=sick))
    assert (new.step, new.last_step) == (0, 5)
    assert tracker.update(snapshot(10, grads=sick)) == []
    assert [(f.step, f.last_step) for f in tracker.findings] == [(0, 10)]
    tracker.update(snapshot(15, grads=grads(fc1=1.0, pool=1.0, fc2=1.0)))  # healed
    tracker.update(snapshot(20, grads=sick))
    tracker.update(snapshot(25, grads=sick))  # back again: the same finding, not a new one
    assert [(f.step, f.last_step) for f in tracker.findings] == [(0, 25)]


def test_the_summary_has_a_line_per_finding() -> None:
    finding = HealthFinding("nonfinite", ("fc1",), 4, 9, 3.0, 0.0, "Look at fc1.")
    assert summary([finding], 10).splitlines() == [
        "HealthMonitor: 1 problem(s) found in 10 steps:",
        "  nonfinite in fc1 (steps 4-9): Look at fc1.",
    ]


def test_on_a_cpu_the_ring_takes_the_norms_of_steps_that_could_be_spikes_and_keeps_losses_as_numbers() -> None:
    from lightning_hooks.recorders.steps import LossRing
    from lightning_hooks.stats.batch import StatBatch

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 2.0)
    ring = LossRing([weight], size=8, device=torch.device("cpu"), threshold=20.0)
    for step in (0, 1):  # no loss history yet: every step
        ring.loss(step, torch.tensor(0.5))
        ring.norms(step, logging=False)
    ring.halfway = 1.0
    for step, loss, logging in [(2, 0.5, False), (3, 0.5, True), (4, 3.0, False), (5, math.nan, False)]:
        ring.loss(step, torch.tensor(loss))
        ring.norms(step, logging)
    batch = StatBatch()
    batch.start()
    assert ring.hand_over(batch) == ([0, 1, 2, 3, 4, 5], {0, 1, 3, 4, 5})
    fetched = batch.fetch()
    assert fetched.vectors[("ring", "norms")] == pytest.approx([math.sqrt(12)] * 5)
    assert fetched.vectors[("ring", "loss")][:5] == [0.5, 0.5, 0.5, 0.5, 3.0]


def test_before_the_monitor_has_a_history_the_ring_takes_its_halfway_from_the_first_losses() -> None:
    # The first logging step's ring had every step's norms (49 rows at step 50), as the monitor's halfway waits for
    # a history of 20 losses that it only gets at that logging step.
    from lightning_hooks.recorders.steps import LossRing
    from lightning_hooks.stats.batch import StatBatch

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 2.0)
    ring = LossRing([weight], size=64, device=torch.device("cpu"), threshold=20.0)
    losses = [1.0 + 0.01 * (step % 5) for step in range(SPIKE_MIN_HISTORY)] + [1.02, 9.0, 1.01]
    for step, loss in enumerate(losses):
        ring.loss(step, torch.tensor(loss))
        ring.norms(step, logging=False)
    batch = StatBatch()
    batch.start()
    steps, with_norms = ring.hand_over(batch)
    # median 1.02, MAD 0.01: half-way at 1.02 + 1.4826 * 0.01 * 20 / 2, but at least 5 % of the median
    assert with_norms == {*range(SPIKE_MIN_HISTORY), SPIKE_MIN_HISTORY + 1}
    assert ring.halfway == pytest.approx(1.02 + 0.05 * 1.02 * 10)


def test_the_monitor_pickles_during_fit_without_the_model(tmp_path: Path) -> None:
    monitor = HealthMonitor(log_every_n_steps=2, exclude=["unused"])
    sizes = Probe("on_train_batch_end", lambda trainer, pl_module, *args: len(pickle.dumps(monitor)))
    make_trainer(tmp_path, [monitor, sizes], max_steps=4).fit(TinyNet())
    assert len(sizes.seen) == 4
    assert max(sizes.seen) < 20_000  # findings and settings, no parameters or ring of tensors


def test_without_a_logger_it_still_finds_warns_and_sums_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pl.seed_everything(0, verbose=False)
    monitor = HealthMonitor(log_every_n_steps=5, checks=["dead_units"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], logger=False, max_steps=16).fit(planted.dead_relu())
    assert [(f.check, f.layers) for f in monitor.findings] == [("dead_units", ("net.1",))]
    assert sum("`HealthMonitor` found dead_units" in str(w.message) for w in caught) == 1
    assert "HealthMonitor: 1 problem(s) found in 16 steps:" in capsys.readouterr().out


def test_a_sparse_gradient_is_watched_in_its_dense_form(tmp_path: Path) -> None:
    # Gradient norms are taken on every logging step, and on quiet steps by the loss-spike ring.
    monitor, _ = fit(tmp_path, SparseEmbeddingNet, steps=11, every=5)
    assert sorted(scalars(tmp_path, "health/exploding_gradients")) == [0, 5, 10]  # logged: the check ran
    assert not only(monitor.findings, "nonfinite")


@pytest.mark.parametrize(
    ("rise", "found"),
    [([0.001, 0.01, 0.1, 0.4], False), ([2.0, 20.0, 200.0], True)],
    ids=["out of a dip", "from the level it held"],
)
def test_a_gradient_norm_is_exploding_when_it_rises_far_above_the_level_it_held(rise: list[float], found: bool) -> None:
    # A converged classifier's batches mostly have tiny gradients: the logged norm dips 200-fold, then comes back.
    tracker = HealthTracker(["exploding_gradients"], Thresholds())
    levels = [0.2] * 8 + rise
    for i, level in enumerate(levels):
        tracker.update(snapshot(10 * i, grads=grads(fc1=level, fc2=level)))
    assert [f.check for f in tracker.findings] == (["exploding_gradients"] if found else [])

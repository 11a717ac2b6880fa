"""NonFiniteGuard's replay mode in real fits: a sentinel on healthy steps, a replay on the step that goes bad."""

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hooks import NonFiniteError, NonFiniteGuard
from lightning_hooks.callbacks.nonfinite_guard import SKIPPED_TAG, TEXT_TAG
from lightning_hooks.core.handles import HookHandles, observers_asleep
from lightning_hooks.recorders.activations import ActivationRecorder
from lightning_hooks.stats.batch import StatBatch
from tests.callbacks.test_nonfinite_guard import ChainNet, ManualChainNet, Snapshots, guard_warnings, same
from tests.support.helpers import TinyNet, devices, events, hook_state, make_trainer, scalars, texts
from tests.support.zoo import ResNetish
from tests.unit.test_finite_core import Log

MODES = ["replay", "eager"]


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


class RandomLog(nn.Module):
    """Dropout-like: a random mask decides where ``log`` is taken of a negative number (about 2 % of values).

    Remembers where it made NaN at each call, so that a test can compare the step with its replay.
    """

    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * torch.log(torch.rand_like(x) * 1.05 - 0.02 + 0.0 * x)
        self.made.append(torch.isnan(out).detach().clone())
        return out


def fit_raising(tmp_path: Path, model: pl.LightningModule, mode: str, **kwargs: Any) -> NonFiniteError:
    before = hook_state(model)
    with pytest.raises(NonFiniteError, match=r"`NonFiniteGuard` found NaN/Inf values") as err:
        make_trainer(tmp_path, [NonFiniteGuard(mode=mode)], **kwargs).fit(model)
    assert hook_state(model) == before  # no hook left behind
    return err.value


@pytest.mark.parametrize("mode", MODES)
def test_a_data_dependent_nan_in_the_third_layer_is_named_with_its_step_and_batch(tmp_path: Path, mode: str) -> None:
    error = fit_raising(tmp_path, ChainNet(Log(), bad_batches=(3,)), mode)
    finding = error.finding
    assert finding is not None
    assert (finding.phase, finding.module, finding.module_type, finding.made_here) == ("forward", "layer3", "Log", True)
    assert (finding.step, finding.batch_idx, finding.replayed) == (3, 3, mode == "replay")
    assert finding.tensor is not None
    assert finding.tensor[1].nonfinite == 1
    assert "step 3, batch 3" in str(error)
    assert "`layer3` (Log)" in texts(tmp_path, TEXT_TAG)[3]


@pytest.mark.parametrize("mode", MODES)
def test_an_inf_gradient_from_sqrt_at_zero_is_named_as_backward(tmp_path: Path, mode: str) -> None:
    model = ChainNet(Sqrt())
    model.x[1, 2] = 0.0  # batch 0, while fc1 is the identity: sqrt is finite at 0, its derivative is not
    error = fit_raising(tmp_path, model, mode)
    finding = error.finding
    assert finding is not None
    assert (finding.phase, finding.module, finding.made_here, finding.step, finding.batch_idx) == (
        "backward",
        "layer3",
        True,
        0,
        0,
    )
    assert finding.tensor is not None
    assert finding.tensor[1].nonfinite == 1
    assert {name for name, _ in finding.parameters} == {"fc1.weight", "fc1.bias"}
    assert "backward: `layer3` (Sqrt) made the gradient w.r.t. its input non-finite" in str(error)
    assert "values are Inf" in str(error)


@pytest.mark.parametrize("device", devices())
def test_a_nan_that_depends_on_the_random_stream_is_reproduced_by_the_replay(tmp_path: Path, device: str) -> None:
    torch.manual_seed(3)
    layer = RandomLog()
    error = fit_raising(tmp_path, ChainNet(layer), "replay", accelerator=device)
    finding = error.finding
    assert finding is not None
    # The last call was the replay of the step's one micro-batch, the one before it the step itself.
    step_mask, replay_mask = layer.made[-2], layer.made[-1]
    assert all(not bool(m.any()) for m in layer.made[:-2])  # the earlier steps were clean
    assert bool(step_mask.any())
    assert torch.equal(replay_mask, step_mask)  # the same random values, so the same NaN
    assert (finding.phase, finding.module, finding.step, finding.batch_idx) == (
        "forward",
        "layer3",
        len(layer.made) - 2,
        len(layer.made) - 2,
    )
    assert finding.tensor is not None
    assert finding.tensor[1].nonfinite == int(step_mask.sum())


@pytest.mark.parametrize("micro_batch", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_under_accumulation_the_micro_batch_that_made_the_nan_is_named(
    tmp_path: Path, mode: str, micro_batch: int
) -> None:
    bad = 3 + micro_batch - 1  # step 1 is made of batches 3, 4 and 5
    error = fit_raising(tmp_path, ChainNet(Log(), bad_batches=(bad,)), mode, accumulate_grad_batches=3)
    assert error.finding is not None
    assert (error.finding.phase, error.finding.step, error.finding.batch_idx) == ("forward", 1, bad)
    assert f"step 1, batch {bad}" in str(error)


class BatchNormRandomChain(ChainNet):
    """ChainNet behind batch norm (buffers a replay must not move) and dropout (a random stream it must not
    advance); an input of -1 (``bad_batches``) still reaches the log. ``none_at`` makes ``training_step``
    return ``None`` at that batch, after its forward: Lightning then skips backward and the optimizer step."""

    def __init__(self, none_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(Log(), **kwargs)
        self.norm, self.drop, self.none_at = nn.BatchNorm1d(4), nn.Dropout(0.3), none_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.where(x < -0.9, -1.0, self.drop(self.norm(x)).abs() + 0.5))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == self.none_at else loss


@pytest.mark.parametrize("device", devices())
def test_a_replayed_step_leaves_weights_buffers_and_random_stream_as_without_the_guard(
    tmp_path: Path, device: str
) -> None:
    def fit(model: BatchNormRandomChain, callbacks: list[pl.Callback]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        make_trainer(tmp_path, callbacks, logger=False, accelerator=device).fit(model)
        return model.state_dict(), torch.rand(4, device=device)

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"`layer3` \(Log\)[\s\S]*step 2, batch 2"):
        guarded, guarded_next = fit(BatchNormRandomChain(bad_batches=(2,)), [NonFiniteGuard(action="skip_step")])
    torch.manual_seed(0)  # the same fit without the guard, its bad step skipped by the model itself
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*`training_step` returned `None`")
        plain, plain_next = fit(BatchNormRandomChain(bad_batches=(2,), none_at=2), [])
    assert guarded.keys() == plain.keys()
    for name in plain:  # bit for bit, the batch norm's running statistics included
        assert torch.equal(guarded[name], plain[name]), name
    assert torch.equal(guarded_next, plain_next)  # the random stream is where it would have been


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_replay_skip_step_keeps_weights_and_optimizer_state_bit_identical(tmp_path: Path, optimizer: str) -> None:
    snapshots = Snapshots()
    model = ChainNet(Sqrt(), optimizer=optimizer)
    model.x[0, 1] = 0.0
    before = hook_state(model)
    with pytest.warns(UserWarning, match=r"backward: `layer3` \(Sqrt\)[\s\S]*the optimizer step is skipped"):
        make_trainer(tmp_path, [NonFiniteGuard(action="skip_step"), snapshots], max_steps=3).fit(model)
    params, state = snapshots.start[0]
    assert same(params, snapshots.end[0][0])
    assert same(state, snapshots.end[0][1])
    assert not same(snapshots.start[1][0], snapshots.end[1][0])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert hook_state(model) == before


def fit_and_raise(tmp_path: Path, model: ChainNet, **kwargs: Any) -> tuple[NonFiniteError, pl.Trainer, Snapshots]:
    snapshots = Snapshots()
    trainer = make_trainer(tmp_path, [NonFiniteGuard(), snapshots], **kwargs)
    with pytest.raises(NonFiniteError) as err:
        trainer.fit(model)
    return err.value, trainer, snapshots


def test_a_fused_optimizer_skips_the_failed_step_and_the_guard_reports_it_at_the_next_as_it_would_have(
    tmp_path: Path,
) -> None:
    # Handed the flag, the fused AdamW skips step 3 on the device; the guard reads the flag at step 4's check (no
    # host wait at step 3) and replays step 3 then, its weights kept by the skip. The report is the synchronous one's.
    torch.manual_seed(0)
    fused, trainer, snapshots = fit_and_raise(
        tmp_path / "fused", ChainNet(Log(), bad_batches=(3,), optimizer="fused adamw")
    )
    torch.manual_seed(0)
    plain, plain_trainer, _ = fit_and_raise(tmp_path / "plain", ChainNet(Log(), bad_batches=(3,), optimizer="adamw"))
    assert (trainer.global_step, plain_trainer.global_step) == (4, 3)  # raised before step 4's optimizer step
    weights = {name: p.detach() for name, p in trainer.lightning_module.named_parameters()}
    assert same(weights, snapshots.start[3][0])  # step 3 changed nothing
    assert fused.finding is not None
    assert plain.finding is not None
    for f in (fused.finding, plain.finding):
        assert (f.phase, f.module, f.step, f.batch_idx, f.replayed, f.made_here) == (
            "forward",
            "layer3",
            3,
            3,
            True,
            True,
        )
    assert repr(fused.finding.tensor) == repr(plain.finding.tensor)  # (NaN is not equal to NaN)
    # The parameters' gradients are gone at step 4: the replay takes them again.
    assert [(name, r.nonfinite) for name, r in fused.finding.parameters] == [
        (name, r.nonfinite) for name, r in plain.finding.parameters
    ]
    assert str(fused).splitlines()[:3] == str(plain).splitlines()[:3]


@pytest.mark.parametrize("every", [1, 2])
def test_a_flag_handed_to_a_fused_optimizer_is_read_at_the_next_optimizer_step_checked_or_not(
    tmp_path: Path, every: int
) -> None:
    # Step 3 is not checked when checking every 2 steps: step 2's flag is read there all the same, before the weights
    # move on from those the failed step kept.
    model = ChainNet(Log(), bad_batches=(2,), optimizer="fused adamw")
    trainer = make_trainer(tmp_path, [NonFiniteGuard(check_every_n_steps=every)])
    with pytest.raises(NonFiniteError, match=r"step 2, batch 2") as err:
        trainer.fit(model)
    assert err.value.finding is not None
    assert (err.value.finding.step, err.value.finding.module, trainer.global_step) == (2, "layer3", 3)


def test_a_failed_last_step_handed_to_a_fused_optimizer_is_reported_at_the_end_of_training(tmp_path: Path) -> None:
    error, trainer, _ = fit_and_raise(tmp_path, ChainNet(Log(), bad_batches=(3,), optimizer="fused adamw"), max_steps=4)
    assert error.finding is not None
    assert (error.finding.step, error.finding.module, trainer.global_step) == (3, "layer3", 4)
    assert not hasattr(trainer.optimizers[0], "found_inf")  # the flag was taken back


@pytest.mark.parametrize("device", devices())
def test_skip_step_with_a_fused_optimizer_keeps_weights_and_state_bit_identical(tmp_path: Path, device: str) -> None:
    # On an accelerator the flag goes to pinned memory behind an event, read at step 2.
    snapshots, guard = Snapshots(), NonFiniteGuard(action="skip_step")
    model = ChainNet(Log(), bad_batches=(1,), optimizer="fused adamw")
    before = hook_state(model)
    with pytest.warns(UserWarning, match=r"at step 1:\nforward: `layer3` \(Log\)[\s\S]*the optimizer step is skipped"):
        make_trainer(tmp_path, [guard, snapshots], max_steps=4, accelerator=device).fit(model)
    assert same(snapshots.start[1][0], snapshots.end[1][0])
    assert same(snapshots.start[1][1], snapshots.end[1][1])  # the step count and both moments
    assert not same(snapshots.start[2][0], snapshots.end[2][0])  # the next steps learn
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert guard.skipped_steps == 1
    assert scalars(tmp_path, SKIPPED_TAG) == {1: 1.0}
    assert hook_state(model) == before


class LoggingChain(ChainNet):
    """Logs its loss every step and a count of its steps per epoch; counts every call of ``training_step``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(Log(), **kwargs)
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.log_dict({"steps_seen": 1.0}, on_step=False, on_epoch=True, reduce_fx="sum")
        return loss


def test_self_log_in_training_step_logs_once_on_a_replayed_step(tmp_path: Path) -> None:
    model = LoggingChain(bad_batches=(2, 5))
    before = hook_state(model)
    with pytest.warns(UserWarning, match=r"found NaN/Inf values at step 2"):
        make_trainer(tmp_path, [NonFiniteGuard(action="warn")], max_epochs=1, max_steps=-1, log_every_n_steps=1).fit(
            model
        )
    batches = len(model.x) // model.batch_size
    assert model.calls > batches  # steps were replayed (from step 2 on, the weights are NaN)
    logged = events(tmp_path)
    assert [e.value for e in logged.Scalars("steps_seen")] == [batches]
    losses = logged.Scalars("train_loss")
    assert [e.step for e in losses] == list(range(batches))  # one value a step, replayed or not
    assert hook_state(model) == before


def test_manual_optimization_is_guarded_eagerly_and_says_so_once(tmp_path: Path) -> None:
    model = ManualChainNet(Log(), bad_batches=(2,))
    before = hook_state(model)
    trainer = make_trainer(tmp_path, [NonFiniteGuard()])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(NonFiniteError, match=r"step 2, batch 2") as err:
            trainer.fit(model)
    said = [w for w in guard_warnings(record) if "mode='eager'" in w]
    assert said == [
        "`NonFiniteGuard` uses `mode='eager'` (hooks on every checked step): with manual optimization, replaying "
        "`training_step` would step the optimizer again."
    ]
    assert err.value.finding is not None
    assert (err.value.finding.module, err.value.finding.replayed) == ("layer3", False)
    assert hook_state(model) == before


class InPlaceRepair(ChainNet):
    """``training_step`` repairs its batch in place after using it: a replay sees a different batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x.clone()), y)
        x.abs_()
        return loss


def test_a_step_the_replay_does_not_reproduce_is_reported_as_such(tmp_path: Path) -> None:
    model = InPlaceRepair(Log(), bad_batches=(1,))
    with pytest.raises(NonFiniteError, match=r"the replay of the step found every value it measured finite") as err:
        make_trainer(tmp_path, [NonFiniteGuard()]).fit(model)
    finding = err.value.finding
    assert finding is not None
    assert (finding.phase, finding.reproduced, finding.replayed, finding.step, finding.batch_idx) == (
        "loss",
        False,
        True,
        1,
        1,
    )
    assert "it did not reproduce" in str(err.value)
    assert "`fc1.weight`" in str(err.value)  # what the sentinel saw in the gradients


class HookProbe(pl.Callback):
    """The hooks of every module and parameter at each point of every step, after the guard ran its own."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, dict]] = []

    def look(self, where: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen.append((where, trainer.global_step, hook_state(pl_module)))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.look("batch start", trainer, pl_module)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.look("before backward", trainer, pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.look("before optimizer step", trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.look("batch end", trainer, pl_module)


class ForwardSpy(TinyNet):
    """Also looks at its modules' hooks from inside ``forward``, where the guard's hooks would fire."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inside.append(hook_state(self))
        return super().forward(x)


@pytest.mark.parametrize("model", [ForwardSpy, ResNetish], ids=["tiny", "resnet-inplace-relu"])
def test_a_healthy_run_attaches_no_hook_on_any_step(tmp_path: Path, model: type[pl.LightningModule]) -> None:
    net, probe = model(), HookProbe()
    before = hook_state(net)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [NonFiniteGuard(), probe], max_steps=4, accumulate_grad_batches=2).fit(net)
    assert guard_warnings(record) == []
    assert [step for where, step, _ in probe.seen if where == "before optimizer step"] == [0, 1, 2, 3]
    assert len([where for where, _, _ in probe.seen if where == "before backward"]) > 4  # accumulated
    assert all(state == before for _, _, state in probe.seen)
    assert all(state == before for state in getattr(net, "inside", []))
    assert TEXT_TAG not in events(tmp_path).Tags()["tensors"]


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match=r"`NonFiniteGuard` got `mode='lazy'`; `mode` must be 'replay' or 'eager'"):
        NonFiniteGuard(mode="lazy")  # type: ignore[arg-type]


def test_other_recorders_sleep_through_a_replay_and_the_users_hooks_do_not() -> None:
    layer, batch = nn.Linear(2, 2), StatBatch()
    batch.start()
    calls: list[str] = []
    with HookHandles() as handles:
        handles.add(layer.register_forward_hook(lambda *_: calls.append("user, first")))
        ActivationRecorder(batch).attach([("", layer)], handles)
        handles.add(layer.register_forward_hook(lambda *_: calls.append("user, last")))
        with observers_asleep():
            layer(torch.ones(1, 2))
    assert not batch.fetch().states  # the activation recorder saw nothing
    assert calls == ["user, first", "user, last"]
    assert not layer._forward_hooks

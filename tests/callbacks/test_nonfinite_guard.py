"""NonFiniteGuard in real Lightning fits: what it names, what each action does, what it leaves behind."""

import copy
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_hooks import NonFiniteError, NonFiniteGuard
from lightning_hooks.callbacks.nonfinite_guard import SKIPPED_TAG, TEXT_TAG
from tests.support.helpers import NaNWeight, TinyNet, events, hook_state, make_trainer, scalars, texts
from tests.support.pretrained import third_party
from tests.support.zoo import MaskedClasses, ResNetish, ZooModule
from tests.unit.test_finite_core import BadBackward, Log, NaNGrad


class NaNWeightGrad(nn.Linear):
    """A linear layer whose weight gradient gets a NaN; the gradients of its input and output stay finite."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, NaNGrad.apply(self.weight), self.bias)


class ChainNet(ZooModule):
    """``fc1 → act → layer3 → head`` on positive data; in each of ``bad_batches`` one value is -1.

    ``fc1`` starts as the identity and ``act`` passes values through, so with ``layer3=Log()``
    the -1 reaches the log in the third layer. ``repair`` replaces non-finite values after
    ``layer3`` by numbers, so that a NaN made there does not spread to the weights.
    """

    def __init__(
        self,
        layer3: nn.Module,
        bad_batches: tuple[int, ...] = (),
        repair: bool = False,
        optimizer: str = "sgd",
        **kwargs: Any,
    ) -> None:
        super().__init__(n=64, batch_size=8, lr=1e-3, **kwargs)
        self.fc1, self.act, self.layer3, self.head = nn.Linear(4, 4), nn.Hardtanh(-3, 3), layer3, nn.Linear(4, 3)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.eye(4))
            self.fc1.bias.zero_()
        self.x = self.x.abs() + 0.5
        for batch in bad_batches:
            self.x[batch * self.batch_size, 0] = -1.0
        self.repair, self.optimizer = repair, optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer3(self.act(self.fc1(x)))
        return self.head(torch.nan_to_num(h) if self.repair else h)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        if self.optimizer in ("adamw", "fused adamw"):  # fused, it skips a step itself when handed a `found_inf` flag
            return torch.optim.AdamW(self.parameters(), lr=0.01, fused=self.optimizer == "fused adamw")
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def guard_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "NonFiniteGuard" in str(w.message)]


def test_a_log_of_a_negative_input_in_the_third_layer_is_named_and_the_fit_stops_clean(tmp_path: Path) -> None:
    model = ChainNet(Log(), bad_batches=(2,))
    before = hook_state(model)
    with pytest.raises(
        NonFiniteError, match=r"forward: `layer3` \(Log\) made non-finite values from finite inputs"
    ) as err:
        make_trainer(tmp_path, [NonFiniteGuard()]).fit(model)
    finding = err.value.finding
    assert finding is not None
    # The weights are those the bad step started from: recompute what the log was given.
    with torch.no_grad():
        given = model.act(model.fc1(model.x[16:24]))
    assert (finding.phase, finding.module, finding.module_type, finding.batch_idx) == ("forward", "layer3", "Log", 2)
    path, output = finding.tensor  # type: ignore[misc]
    assert (path, output.nonfinite, output.numel) == ("", 1, given.numel())
    ((_, inputs),) = finding.given
    assert inputs.min == pytest.approx(float(given.min()), abs=1e-6)
    assert inputs.max == pytest.approx(float(given.max()), abs=1e-6)
    message = str(err.value)
    assert "output: 1 of 32 values are NaN" in message
    assert f"inputs: input min {given.min():.4g}, max {given.max():.4g}" in message
    assert "step 2, batch 2" in message
    assert "`head.weight` (12 of 12)" in message
    # Stopped before the optimizer step: no NaN reached the weights; no hook is left; the report is on disk.
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert hook_state(model) == before
    assert "`layer3` (Log)" in texts(tmp_path, TEXT_TAG)[2]


def test_a_custom_function_with_a_nan_gradient_is_named_in_backward(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=r"backward: `layer3` \(BadBackward\) made the gradient") as err:
        make_trainer(tmp_path, [NonFiniteGuard()]).fit(ChainNet(BadBackward()))
    finding = err.value.finding
    assert finding is not None
    assert (finding.phase, finding.module, finding.batch_idx, finding.made_here) == ("backward", "layer3", 0, True)
    assert finding.tensor[1].nonfinite == 1  # type: ignore[index]
    assert all(math.isfinite(r.min) and math.isfinite(r.max) for _, r in finding.given)
    # Upstream of the bad gradient the parameters are NaN, downstream they are not.
    assert {name for name, _ in finding.parameters} == {"fc1.weight", "fc1.bias"}


def test_a_nan_parameter_gradient_alone_is_reported(tmp_path: Path) -> None:
    with pytest.raises(
        NonFiniteError, match=r"parameter gradients with NaN/Inf values: `layer3.weight` \(1 of 16\)"
    ) as err:
        make_trainer(tmp_path, [NonFiniteGuard()]).fit(ChainNet(NaNWeightGrad(4, 4)))
    assert err.value.finding is not None
    assert err.value.finding.phase == "parameter"


def test_without_backward_checks_a_nan_gradient_is_seen_one_step_later_in_the_weights(tmp_path: Path) -> None:
    guard = NonFiniteGuard(action="warn", check_backward=False)
    with pytest.warns(UserWarning, match=r"forward: `fc1` \(Linear\) made non-finite values from finite inputs"):
        make_trainer(tmp_path, [guard], max_steps=3).fit(ChainNet(BadBackward()))
    assert sorted(texts(tmp_path, TEXT_TAG)) == [1, 2]


class CountingGuard(NonFiniteGuard):
    """Records how many tensors were measured at each check."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.measured: dict[int, int] = {}

    def _check(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        self.measured[step] = len(self._recorder)
        super()._check(trainer, optimizer, step)


@pytest.mark.parametrize("model", [TinyNet, ResNetish], ids=["tiny", "resnet-inplace-relu"])
def test_a_healthy_eager_run_reports_nothing(tmp_path: Path, model: type[pl.LightningModule]) -> None:
    guard = CountingGuard(action="warn", mode="eager")
    net = model()
    before = hook_state(net)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [guard], max_steps=4).fit(net)
    assert guard_warnings(record) == []
    assert sorted(guard.measured) == [0, 1, 2, 3]
    assert all(n > 5 for n in guard.measured.values())
    tags = events(tmp_path).Tags()
    assert TEXT_TAG not in tags["tensors"]
    assert SKIPPED_TAG not in tags["scalars"]
    assert hook_state(net) == before


@pytest.mark.parametrize("fill", [-math.inf, torch.finfo(torch.float32).min], ids=["-inf", "lowest"])
def test_an_eager_guard_leaves_logits_masked_with_minus_inf_alone(tmp_path: Path, fill: float) -> None:
    # Before, the -inf logits of the masked classes, which cross_entropy turns into probabilities of 0, stopped the fit
    # at step 0 in eager mode (as under manual optimization), though the loss and every gradient were finite.
    guard = NonFiniteGuard(action="warn", mode="eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [guard], max_steps=4).fit(MaskedClasses(fill))
    assert guard.last_finding is None
    assert guard_warnings(record) == []


def test_an_eager_guard_names_a_mask_of_nan(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=r"forward: `mask` \(Fill\) made non-finite values from finite inputs"):
        make_trainer(tmp_path, [NonFiniteGuard(mode="eager")], max_steps=4).fit(MaskedClasses(math.nan))


def test_warn_reports_every_time_and_warns_once_per_layer(tmp_path: Path) -> None:
    guard = NonFiniteGuard(action="warn", mode="eager")  # repaired: the NaN reaches neither loss nor gradients
    with pytest.warns(UserWarning, match=r"`NonFiniteGuard` found NaN/Inf values at step 1") as record:
        make_trainer(tmp_path, [guard]).fit(ChainNet(Log(), bad_batches=(1, 4), repair=True))
    assert len(guard_warnings(record)) == 1
    reports = texts(tmp_path, TEXT_TAG)
    assert sorted(reports) == [1, 4]
    assert all("`layer3` (Log)" in report for report in reports.values())
    assert "batch 4" in reports[4]


class Snapshots(pl.Callback):
    """Parameters and optimizer state at the start and at the end of every training batch."""

    def __init__(self) -> None:
        self.start: dict[int, tuple[dict, dict]] = {}
        self.end: dict[int, tuple[dict, dict]] = {}

    @staticmethod
    def take(pl_module: pl.LightningModule, trainer: pl.Trainer) -> tuple[dict, dict]:
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        return params, copy.deepcopy(trainer.optimizers[0].state_dict()["state"])

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.start[trainer.global_step] = self.take(pl_module, trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.end[trainer.global_step - 1] = self.take(pl_module, trainer)


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        same(a[k], b[k]) if isinstance(a[k], dict) else bool(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])))
        for k in a
    )


@pytest.mark.parametrize("optimizer", ["sgd", "adam"], ids=["sgd-momentum", "adam"])
def test_skip_step_leaves_weights_and_optimizer_state_untouched(tmp_path: Path, optimizer: str) -> None:
    snapshots = Snapshots()
    model = ChainNet(Log(), bad_batches=(2, 4), optimizer=optimizer)
    with pytest.warns(UserWarning, match="the optimizer step is skipped"):
        make_trainer(tmp_path, [NonFiniteGuard(action="skip_step"), snapshots]).fit(model)
    for step in (2, 4):
        params, state = snapshots.start[step]
        assert same(params, snapshots.end[step][0]), step
        assert same(state, snapshots.end[step][1]), step
    for step in (1, 3, 5):  # the other steps train as usual
        assert not same(snapshots.start[step][0], snapshots.end[step][0]), step
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert scalars(tmp_path, SKIPPED_TAG) == {2: 1.0, 4: 2.0}
    assert sorted(texts(tmp_path, TEXT_TAG)) == [2, 4]


def test_only_every_nth_step_is_checked(tmp_path: Path) -> None:
    guard = CountingGuard(check_every_n_steps=3, action="warn", mode="eager")
    with pytest.warns(UserWarning, match="at step 3"):
        make_trainer(tmp_path, [guard], max_steps=7).fit(ChainNet(Log(), bad_batches=(1, 3), repair=True))
    assert sorted(guard.measured) == [0, 3, 6]
    assert sorted(texts(tmp_path, TEXT_TAG)) == [3]  # the NaN at step 1 is not seen


class HookSpy(pl.Callback):
    """How many forward hooks ``fc1`` holds at the start of each training batch."""

    def __init__(self) -> None:
        self.hooks: dict[int, int] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.hooks[trainer.global_step] = len(pl_module.fc1._forward_hooks)  # type: ignore[union-attr]


@pytest.mark.parametrize("every", [1, 3])
def test_eager_hooks_are_on_for_checked_steps_only_and_validation_changes_nothing(tmp_path: Path, every: int) -> None:
    guard, spy = CountingGuard(check_every_n_steps=every, mode="eager"), HookSpy()
    trainer = make_trainer(tmp_path, [guard, spy], max_steps=7, val_check_interval=2, limit_val_batches=2)
    trainer.fit(TinyNet())
    assert spy.hooks == {step: int(step % every == 0) for step in range(7)}
    # Validation ran between checked steps, with the hooks on when every=1: each check measured the same.
    assert len(set(guard.measured.values())) == 1


def test_gradient_accumulation_reports_the_micro_batch(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=r"step 1, batch 3"):
        make_trainer(tmp_path, [NonFiniteGuard()], accumulate_grad_batches=2).fit(ChainNet(Log(), bad_batches=(3,)))


class ManualChainNet(ChainNet):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()  # type: ignore[union-attr]


class SometimesNothing(TinyNet):
    """Returns no loss on odd batches: Lightning then skips backward."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


def test_manual_optimization_and_a_missing_loss(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match=r"`layer3` \(Log\)[\s\S]*step 2, batch 2"):
        make_trainer(tmp_path / "manual", [NonFiniteGuard()]).fit(ManualChainNet(Log(), bad_batches=(2,)))
    # Lightning warns (once per process) that `training_step` returned None; the guard must simply carry on.
    trainer = make_trainer(tmp_path / "none", [NonFiniteGuard()], logger=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*`training_step` returned `None`")
        trainer.fit(SometimesNothing())
    assert trainer.global_step == trainer.max_steps


def amp(scaler: torch.amp.GradScaler | None = None) -> dict[str, Any]:
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}


def test_amp_scale_search_overflows_are_the_scalers_business(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # far too large: the first steps overflow
    make_trainer(tmp_path, [NonFiniteGuard()], **amp(scaler)).fit(TinyNet())
    assert scaler.get_scale() < 2.0**40  # the scaler did skip steps, and the guard stayed quiet
    assert TEXT_TAG not in events(tmp_path).Tags()["tensors"]


@pytest.mark.parametrize("action", ["raise", "skip_step"])
def test_amp_forward_findings_are_reported_with_the_scaler_mentioned(tmp_path: Path, action: str) -> None:
    model = ChainNet(Log(), bad_batches=(1,), optimizer="adam")
    trainer = make_trainer(tmp_path, [NonFiniteGuard(action=action)], **amp())
    expected = r"`layer3` \(Log\)[\s\S]*a GradScaler is active \(scale 65536\) and will skip this step"
    with (
        pytest.raises(NonFiniteError, match=expected)
        if action == "raise"
        else pytest.warns(UserWarning, match=expected)
    ):
        trainer.fit(model)
    assert "a GradScaler is active" in texts(tmp_path, TEXT_TAG)[1]
    if action == "skip_step":
        assert scalars(tmp_path, SKIPPED_TAG) == {1: 1.0}
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_the_model_pickles_while_the_eager_hooks_are_on(tmp_path: Path) -> None:
    class Pickling(TinyNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            assert len(self.fc1._forward_hooks) == 1
            pickle.loads(pickle.dumps(self.fc1))
            return super().training_step(batch, batch_idx)

    make_trainer(tmp_path, [NonFiniteGuard(mode="eager")], logger=False, max_steps=2).fit(Pickling())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"check_every_n_steps": 0},
            ValueError,
            r"`NonFiniteGuard` got `check_every_n_steps=0`; `check_every_n_steps` must be a positive integer",
        ),
        ({"check_every_n_steps": None}, ValueError, r"`NonFiniteGuard` got `check_every_n_steps=None`"),
        (
            {"action": "ignore"},
            ValueError,
            r"`NonFiniteGuard` got `action='ignore'`; `action` must be one of 'raise', 'warn', 'skip_step'",
        ),
        (
            {"check_backward": "yes"},
            TypeError,
            r"`NonFiniteGuard` got `check_backward='yes'`; `check_backward` must be True or False",
        ),
        ({"max_depth": -1}, ValueError, r"`NonFiniteGuard` got `max_depth=-1`"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        NonFiniteGuard(**kwargs)


@pytest.mark.parametrize(
    ("kind", "module"),
    [
        ("gpt2", "net.transformer.h.1.mlp.c_fc"),
        ("llama", "net.model.layers.1.mlp.up_proj"),
        ("mixtral", "net.model.layers.0.self_attn.v_proj"),
        ("t5", "net.encoder.block.1.layer.1.DenseReluDense.wo"),
        ("vit", "net.vit.layers.1.attention.k_proj"),
        ("whisper", "net.model.decoder.layers.0.fc1"),
        ("lora", "net.base_model.model.transformer.h.0.mlp.c_proj"),
        ("bert", "net.bert.encoder.layer.1.intermediate.dense"),
        ("resnet", "net.resnet.encoder.stages.1.layers.0.layer.1.convolution"),
        ("segformer", "net.segformer.stages.1.blocks.0.mlp.dwconv.dwconv"),
    ],
)
def test_names_a_broken_layer_of_a_third_party_architecture(tmp_path: Path, kind: str, module: str) -> None:
    # Attention masks full of -inf, caches, MoE routing, a frozen base under LoRA: only the broken layer is named.
    with pytest.raises(NonFiniteError) as raised:
        make_trainer(tmp_path, [NonFiniteGuard(), NaNWeight(module, at=2)], max_steps=4, logger=False).fit(
            third_party(kind)
        )
    finding = raised.value.finding
    assert (finding.module, finding.step, finding.phase) == (module, 2, "forward")

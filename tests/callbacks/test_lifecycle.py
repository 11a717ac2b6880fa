"""Hooks leave with fit, whichever way fit ends."""

import copy
import io
import pickle
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_hooks as lh
from lightning_hooks import GradClamp, ShapeLogger
from tests.support.helpers import Probe, TinyNet, events, hook_state, make_trainer, scalars, texts


@pytest.mark.parametrize("failure", [None, RuntimeError, KeyboardInterrupt])
def test_no_hook_left_behind(tmp_path: Path, failure: type[BaseException] | None) -> None:
    model = TinyNet(fail_at=3 if failure else None, fail_with=failure or RuntimeError)
    before = hook_state(model)
    seen_during_fit: list[dict] = []

    class Spy(ShapeLogger):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            seen_during_fit.append(hook_state(pl_module))

    trainer = make_trainer(tmp_path, [Spy(), GradClamp(0.1)], max_steps=5)
    if failure is RuntimeError:
        with pytest.raises(RuntimeError, match="planned failure"):
            trainer.fit(model)
    elif failure is KeyboardInterrupt:
        # Lightning shuts down gracefully, ignores further Ctrl+C and exits with status 1.
        try:
            with pytest.raises(SystemExit):
                trainer.fit(model)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    else:
        trainer.fit(model)
    assert seen_during_fit, "fit never reached a training step"
    assert seen_during_fit[0] != before, "hooks were not attached during fit"
    assert seen_during_fit[0]["module:unused"] != before["module:unused"]
    assert hook_state(model) == before
    # What was logged before the failure is on disk and readable.
    assert 0 in texts(tmp_path, "shapes/train")


def largest_gradient(trainer: object, model: torch.nn.Module, optimizer: object) -> float:
    return max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)


def test_same_instances_serve_a_second_fit(tmp_path: Path) -> None:
    shapes, clamp = ShapeLogger(), GradClamp(0.05)
    model = TinyNet(lr=0.5)
    make_trainer(tmp_path / "one", [shapes, clamp], max_steps=2).fit(model)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    probe = Probe("on_before_optimizer_step", largest_gradient)
    make_trainer(tmp_path / "two", [shapes, clamp, probe], max_steps=4).fit(model)
    assert 0 in texts(tmp_path / "two", "shapes/train")
    assert any(not torch.equal(first[k], v) for k, v in model.state_dict().items())
    # Still clamping in the second fit: gradients reach the bound and none escapes it.
    assert len(probe.seen) == 4
    assert max(probe.seen) == pytest.approx(0.05)
    assert hook_state(model) == hook_state(TinyNet())


def test_validate_test_and_predict_attach_nothing(tmp_path: Path) -> None:
    model = TinyNet()
    before = hook_state(model)
    seen: list[dict] = []

    class Spy(ShapeLogger):
        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):  # type: ignore[no-untyped-def]
            seen.append(hook_state(pl_module))

    make_trainer(tmp_path, [Spy(), GradClamp(0.1)], limit_val_batches=1).validate(model)
    assert seen == [before]


class _ModelFinder(pickle.Pickler):
    """Pickles to nowhere, noting every module and parameter it meets instead of pickling it."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.found: set[str] = set()

    def persistent_id(self, obj: object) -> str | None:
        if isinstance(obj, (nn.Module, nn.Parameter)):
            self.found.add(type(obj).__name__)
            return "model"
        return None


@pytest.mark.parametrize(
    "make",
    [
        lambda: lh.ShapeLogger(1),
        lambda: lh.GradStats(log_every_n_steps=1),
        lambda: lh.ActivationStats(log_every_n_steps=1),
        lambda: lh.HealthMonitor(log_every_n_steps=1),
        lambda: lh.GradClamp(0.5),
        lambda: lh.NonFiniteGuard(),
        lambda: lh.MemoryLogger(at_step=1),
    ],
    ids=["ShapeLogger", "GradStats", "ActivationStats", "HealthMonitor", "GradClamp", "NonFiniteGuard", "MemoryLogger"],
)
def test_a_callback_pickled_during_a_fit_leaves_the_model_behind(tmp_path: Path, make: Any) -> None:
    # A copy sent to another process or saved must not drag the model along: not the modules it hooks, not their
    # parameters, not the LightningModule's `log` and `log_dict`, which Lightning binds onto every callback.
    callback = make()
    found: set[str] = set()

    def look(trainer: Any, pl_module: Any, *args: Any) -> None:
        finder = _ModelFinder()
        finder.dump(callback)
        found.update(finder.found)

    probes = [Probe(hook, look) for hook in ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")]
    make_trainer(tmp_path, [callback, *probes], max_steps=3).fit(TinyNet())
    assert probes[-1].seen  # the probes ran
    assert found == set()


class Jagged(nn.Module):
    """Returns its batch as torch's jagged nested tensor of two rows, which the statistics cannot reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor([x[:3], x[3:]], layout=torch.jagged)


class JaggedNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.jagged = Jagged()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.jagged(self.act(self.fc1(x))).unbind()
        return self.head(self.act(self.fc2(torch.cat(rows))))


def test_a_hook_that_cannot_record_costs_its_statistics_not_the_fit(tmp_path: Path) -> None:
    # Before: RuntimeError from the nested tensor, and the fit and its logs were lost.
    torch.manual_seed(0)
    model = JaggedNet()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [lh.ActivationStats(log_every_n_steps=1)], max_steps=2, log_every_n_steps=1).fit(model)
    failed = [str(w.message) for w in caught if "could not record" in str(w.message)]
    assert len(failed) == 1, failed  # once, not at every call
    assert failed[0].startswith("lightning_hooks could not record a call of a `Jagged` module (RuntimeError")
    assert model.trainer.global_step == 2
    assert hook_state(model) == hook_state(reference)
    assert "act_mean/jagged" not in events(tmp_path).Tags()["scalars"]
    expected = float(reference.fc1(reference.x[: reference.batch_size]).mean())  # the other layers are recorded
    assert scalars(tmp_path, "act_mean/fc1")[0] == pytest.approx(expected, rel=1e-5)

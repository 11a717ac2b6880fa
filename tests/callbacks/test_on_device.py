"""On each device here (``pytest -m cuda`` runs the CUDA half, skipped without a GPU): the statistics against values
computed independently from the same tensors, in bf16 autocast and in fp16 with a real ``GradScaler``, and no hook
left on the model after a fit with all six callbacks, in float32 and float64."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hooks import ActivationStats, GradClamp, GradStats, HealthMonitor, NonFiniteGuard, ShapeLogger
from lightning_hooks.stats.state import CHUNK
from tests.support.helpers import CUDA, TinyNet, devices, hook_state, make_trainer, scalars


class Truth(pl.Callback):
    """What the tests expect, computed from the tensors themselves in float64: ``fc1``'s output at each step, and
    every parameter's gradient as the optimizer will see it (after unscaling)."""

    def __init__(self) -> None:
        self.outputs: dict[int, torch.Tensor] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def keep(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self.outputs[trainer.global_step] = output.detach().double().cpu()

        self.handle = pl_module.fc1.register_forward_hook(keep)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads[trainer.global_step] = {
            name: p.grad.detach().double().cpu() for name, p in pl_module.named_parameters() if p.grad is not None
        }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.handle.remove()


def fit_with_truth(tmp_path: Path, device: str, precision: str) -> Truth:
    torch.manual_seed(0)
    truth = Truth()
    callbacks = [GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1), truth]
    make_trainer(tmp_path, callbacks, accelerator=device, precision=precision, max_steps=3).fit(TinyNet())
    return truth


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("device", devices())
def test_statistics_match_values_computed_from_the_tensors(tmp_path: Path, device: str, precision: str) -> None:
    truth = fit_with_truth(tmp_path, device, precision)
    assert sorted(truth.outputs) == sorted(truth.grads) == [0, 1, 2]
    if precision == "bf16-mixed" and device == "cuda":
        assert truth.outputs[0].abs().sum() > 0  # autocast made fc1's output bf16; the truth is its float64 copy
    for step in range(3):
        out = truth.outputs[step]
        expected = {
            "act_mean/fc1": out.mean(),
            "act_std/fc1": out.std(unbiased=False),
            "act_abs_max/fc1": out.abs().max(),
            "grad_norm/fc1.weight": truth.grads[step]["fc1.weight"].norm(),
            "grad_norm/head.bias": truth.grads[step]["head.bias"].norm(),
            "grad_norm_total": torch.cat([g.flatten() for g in truth.grads[step].values()]).norm(),
        }
        for tag, value in expected.items():
            assert scalars(tmp_path, tag)[step] == pytest.approx(float(value), rel=1e-4, abs=1e-7), (tag, step)


@pytest.mark.parametrize("device", devices())
def test_fp16_with_a_grad_scaler_logs_unscaled_statistics(tmp_path: Path, device: str) -> None:
    # On the CPU Lightning's "16-mixed" means bf16; fp16 autocast with a real GradScaler is what CUDA runs.
    plugins = [pl.plugins.MixedPrecision("16-mixed", device, torch.amp.GradScaler(device))]
    torch.manual_seed(0)
    start, truth = TinyNet(), Truth()
    callbacks = [GradStats(log_every_n_steps=1), truth]
    trainer = make_trainer(tmp_path / "fp16", callbacks, accelerator=device, plugins=plugins, max_steps=3)
    trainer.fit(copy.deepcopy(start))
    assert trainer.precision_plugin.scaler.get_scale() >= 2.0**15  # the scale, not 1, multiplied the loss
    for step in range(3):
        for name in ("fc1.weight", "fc2.bias", "head.weight"):
            want = float(truth.grads[step][name].norm())
            assert scalars(tmp_path / "fp16", f"grad_norm/{name}")[step] == pytest.approx(want, rel=1e-4), (name, step)


class Overflow(TinyNet):
    """fp16 gradients blown up to Inf at step 1: the scaler skips that step and halves its scale."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        return loss * 1e10 if self.global_step == 1 else loss


@pytest.mark.parametrize("device", devices())
def test_the_guard_lets_the_grad_scaler_skip_its_overflow_and_clamping_equals_lightnings(
    tmp_path: Path, device: str
) -> None:
    torch.manual_seed(0)
    start = Overflow(lr=0.5)
    models = {}
    for name, callbacks, kwargs in (
        ("guarded", [GradClamp(0.02), NonFiniteGuard()], {}),
        ("clipped", [], {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}),
    ):
        plugins = [pl.plugins.MixedPrecision("16-mixed", device, torch.amp.GradScaler(device))]
        models[name] = copy.deepcopy(start)
        trainer = make_trainer(tmp_path / name, callbacks, accelerator=device, plugins=plugins, max_steps=4, **kwargs)
        trainer.fit(models[name])  # the guard raises on a finding: the scaler's own overflow is none
        assert trainer.precision_plugin.scaler.get_scale() == 2.0**15  # halved once, at step 1
    for (name, a), b in zip(models["guarded"].named_parameters(), models["clipped"].parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def all_six() -> list[pl.Callback]:
    return [ShapeLogger(), GradStats(), ActivationStats(), GradClamp(0.5), NonFiniteGuard(), HealthMonitor()]


@pytest.mark.parametrize("precision", ["32-true", "64-true"])  # float64: norms that must not narrow to float32
@pytest.mark.parametrize("device", devices())
def test_no_hook_is_left_on_the_model_after_a_fit_with_all_six(tmp_path: Path, device: str, precision: str) -> None:
    model = TinyNet()
    before = hook_state(model)
    trainer = make_trainer(
        tmp_path, all_six(), accelerator=device, precision=precision, max_steps=4, log_every_n_steps=1
    )
    trainer.fit(model)
    assert hook_state(model) == before
    assert scalars(tmp_path, "grad_norm_total")  # the callbacks did run


class Logits(pl.LightningModule):
    """A language-model head whose logits (64 x 64 x 32768 float32, 512 MiB) dwarf everything else."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(256, 64), nn.Linear(64, 32768)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.embed(batch[0]))
        return F.cross_entropy(logits.flatten(0, 1), batch[0].flatten() * 128)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        tokens = torch.randint(0, 256, (256, 64), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=64)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_statistics_of_a_large_tensor_take_bounded_memory(tmp_path: Path, device: str) -> None:
    peaks = {}
    for name, callbacks in (("none", []), ("all six", all_six())):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        make_trainer(tmp_path / name, callbacks, accelerator=device, max_steps=2, log_every_n_steps=1).fit(Logits())
        peaks[name] = torch.cuda.max_memory_allocated()
    # Reduced whole, the logits and their gradient would each take three float32 copies (1.5 GiB) at once.
    assert peaks["all six"] - peaks["none"] < 6 * 4 * CHUNK, peaks

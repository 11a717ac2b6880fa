"""A quiet step makes no host read, on any device, except ``NonFiniteGuard``'s one flag per optimizer step.

A host read is what makes the host wait for the device: ``aten._local_scalar_dense`` (what ``.item()``,
``float(t)`` and ``bool(t)`` run) and a copy from an accelerator to the CPU. They are counted with a
``TorchDispatchMode`` held from the first callback's ``on_train_batch_start`` to the last one's
``on_train_batch_end`` of each quiet step (one that is not a logging step), so every hook of the
callbacks under test runs inside it. On a CPU, ``.tolist()`` and ``.numpy()`` read host memory
without dispatching anything; the run on an accelerator (where there is one) sees them as copies.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_hooks
from lightning_hooks import ActivationStats, GradClamp, GradStats, HealthMonitor, NonFiniteGuard, ShapeLogger
from tests.support.helpers import TinyNet, devices, make_trainer

aten = torch.ops.aten
PACKAGE = str(Path(lightning_hooks.__file__).parent)
EVERY = 5
STEPS = 12
QUIET = [s for s in range(STEPS) if s % EVERY]
LOGGING = [s for s in range(STEPS) if s % EVERY == 0]


def _where() -> str:
    """``file:line`` of the innermost frame in this package (else the innermost outside torch) that asked."""
    frames = traceback.extract_stack()[:-3]
    ours = [f for f in frames if f.filename.startswith(PACKAGE)]
    outside = [f for f in frames if "/torch/" not in f.filename]
    frame = (ours or outside or frames)[-1]
    name = frame.filename[len(PACKAGE) + 1 :] if ours else Path(frame.filename).name
    return f"{name}:{frame.lineno}"


class HostReads(TorchDispatchMode):
    """Records where each host read happens."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            self.reads.append(_where())
        elif func is aten._to_copy.default and args[0].device.type != "cpu":
            if torch.device(kwargs.get("device") or args[0].device).type == "cpu":
                self.reads.append(_where())
        elif func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            # A copy into pinned memory that does not block leaves the host running: not a read until it is used.
            waits = not (args[0].is_pinned() and (args[2:] or [kwargs.get("non_blocking")])[0])
            self.reads += [_where()] if waits else []
        return func(*args, **kwargs)


class MeteredSteps:
    """Two callbacks, ``first`` and ``last``, that hold a :class:`HostReads` over each quiet step's batch (each
    logging step's, with ``logging``); ``per_step`` holds the reads of each such step."""

    def __init__(self, logging: bool = False, every: int = EVERY) -> None:
        self.mode = HostReads()
        self.steps: list[int] = []
        self.per_step: list[list[str]] = []
        self.active = False
        meter = self

        class First(pl.Callback):
            def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
                if (trainer.global_step % every == 0) == logging:
                    meter.steps.append(trainer.global_step)
                    meter.mode.reads = []
                    meter.per_step.append(meter.mode.reads)
                    meter.mode.__enter__()
                    meter.active = True

        class Last(pl.Callback):
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                meter.leave()

            def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
                meter.leave()

        self.first, self.last = First(), Last()

    def leave(self) -> None:
        if self.active:
            self.active = False
            self.mode.__exit__(None, None, None)


class FusedNet(TinyNet):
    """TinyNet under a fused AdamW, which skips a step on the device when handed a ``found_inf`` flag."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)


def step_reads(
    tmp_path: Path,
    callbacks: list[pl.Callback],
    device: str,
    logging: bool = False,
    steps: int = STEPS,
    every: int = EVERY,
    model: type[TinyNet] = TinyNet,
) -> list[list[str]]:
    """Where each host read of each quiet step (each logging step, with ``logging``) of a 12-step fit happened."""
    meter = MeteredSteps(logging, every)
    trainer = make_trainer(
        tmp_path,
        [meter.first, *callbacks, meter.last],
        accelerator=device,
        max_steps=steps,
        log_every_n_steps=every,
    )
    trainer.fit(model(n=64, batch_size=16))  # every batch the same shape: ShapeLogger has no reason to look
    assert meter.steps == [s for s in range(steps) if (s % every == 0) == logging]
    return meter.per_step


def quiet_reads(tmp_path: Path, callbacks: list[pl.Callback], device: str) -> list[str]:
    """Where each host read of the quiet steps of a 12-step fit happened."""
    return [where for reads in step_reads(tmp_path, callbacks, device) for where in reads]


def all_six() -> list[pl.Callback]:
    return [ShapeLogger(), GradStats(), ActivationStats(), GradClamp(0.5), NonFiniteGuard(), HealthMonitor()]


CALLBACKS = {
    "ShapeLogger": ShapeLogger,
    "GradStats": GradStats,
    "ActivationStats": ActivationStats,
    "GradClamp": lambda: GradClamp(0.5),
    "HealthMonitor": HealthMonitor,
}


@pytest.mark.parametrize("device", devices())
def test_lightning_alone_reads_nothing_on_a_quiet_step(tmp_path: Path, device: str) -> None:
    # The baseline the callbacks are measured against: with no progress bar and no logged loss, none.
    assert quiet_reads(tmp_path, [], device) == []


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", CALLBACKS)
def test_a_callback_reads_nothing_on_a_quiet_step(tmp_path: Path, name: str, device: str) -> None:
    assert quiet_reads(tmp_path, [CALLBACKS[name]()], device) == []


@pytest.mark.parametrize("device", devices())
def test_the_health_monitor_reads_nothing_once_its_ring_knows_the_half_way_loss(tmp_path: Path, device: str) -> None:
    # Logging every 30 steps, the ring holds 31 losses: from step 21 it knows the half-way loss to a spike, and on a
    # CPU it compares each quiet step's loss with it. It did so with `float(loss)`, a host read the meter sees (no
    # wait on a CPU, but a read all the same); it now keeps the loss as a number read from host memory.
    reads = step_reads(tmp_path, [HealthMonitor()], device, steps=40, every=30)
    assert [where for step in reads for where in step] == []


@pytest.mark.parametrize("device", devices())
def test_nonfinite_guard_reads_its_one_flag_per_optimizer_step(tmp_path: Path, device: str) -> None:
    reads = quiet_reads(tmp_path, [NonFiniteGuard()], device)
    assert len(reads) == len(QUIET), reads
    assert len(set(reads)) == 1, reads  # one place: the flag


@pytest.mark.parametrize("device", devices())
def test_nonfinite_guard_reads_nothing_where_the_optimizer_skips_a_failed_step_itself(
    tmp_path: Path, device: str
) -> None:
    # Handed the flag as `found_inf`, a fused optimizer skips a failed step on the device; the guard reads the flag
    # one step later, from host memory (on an accelerator, copied there without waiting), and dispatches no read.
    reads = step_reads(tmp_path, [NonFiniteGuard()], device, model=FusedNet)
    assert [where for step in reads for where in step] == []
    # `warn` lets a failed step change the weights, so it checks before the step, as with any other optimizer.
    warned = step_reads(tmp_path / "warn", [NonFiniteGuard(action="warn")], device, model=FusedNet)
    assert [len(step) for step in warned] == [1] * len(QUIET), warned


@pytest.mark.parametrize("device", devices())
def test_all_six_read_only_the_guards_flag(tmp_path: Path, device: str) -> None:
    reads = quiet_reads(tmp_path, all_six(), device)
    assert reads == quiet_reads(tmp_path / "guard", [NonFiniteGuard()], device)
    assert len(reads) <= len(QUIET)
    without_guard = [c for c in all_six() if not isinstance(c, NonFiniteGuard)]
    assert quiet_reads(tmp_path / "without", without_guard, device) == []


@pytest.mark.parametrize("device", devices())
def test_a_logging_step_reads_at_most_once_per_callback(tmp_path: Path, device: str) -> None:
    # On a CPU the mode sees `item`, `float` and `bool` but not `tolist`, which reads without dispatching: the
    # statistics' one read per logging step is seen on an accelerator.
    assert step_reads(tmp_path, [], device, logging=True) == [[]] * len(LOGGING)
    for name, make in {**CALLBACKS, "NonFiniteGuard": NonFiniteGuard}.items():
        reads = step_reads(tmp_path / name, [make()], device, logging=True)
        assert all(len(step) <= 1 for step in reads), (name, reads)
    reads = step_reads(tmp_path / "all", all_six(), device, logging=True)
    assert all(len(step) <= len(all_six()) for step in reads), reads


def test_the_meter_sees_a_read(tmp_path: Path) -> None:
    class Reads(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            float(pl_module.fc1.weight.grad.sum())  # type: ignore[union-attr]
            bool(pl_module.fc1.weight.grad.isfinite().all())  # type: ignore[union-attr]

    first = Reads.on_before_optimizer_step.__code__.co_firstlineno
    lines = [f"{Path(__file__).name}:{first + n}" for n in (1, 2)]
    assert quiet_reads(tmp_path, [Reads()], "cpu") == lines * len(QUIET)

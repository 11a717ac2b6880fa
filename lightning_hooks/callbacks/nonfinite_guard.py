"""NonFiniteGuard: name the first layer that made a NaN or an Inf, forward or backward."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hooks.callbacks.base import HookCallback, loss_scaler, overflow_flags, tensor_parallel_mesh
from lightning_hooks.core import validate as _validate
from lightning_hooks.core.compiled import eager_stance, has_compiled, run_eager
from lightning_hooks.core.select import named_parameters
from lightning_hooks.core.shards import local
from lightning_hooks.diagnose.finding import Finding, Reading, first_finding, with_parameters
from lightning_hooks.diagnose.replay import MicroBatch, RngState, replay, training_flags
from lightning_hooks.recorders.finite import (
    NonFiniteRecorder,
    finite_step,
    grad_readings,
    nonfinite_flag,
    parameter_readings,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NonFiniteError", "NonFiniteGuard"]

Action = Literal["raise", "warn", "skip_step"]
ACTIONS: tuple[Action, ...] = ("raise", "warn", "skip_step")
Mode = Literal["replay", "eager"]
MODES: tuple[Mode, ...] = ("replay", "eager")
TEXT_TAG = "nonfinite/first_layer"
SKIPPED_TAG = "nonfinite/skipped_steps"


class NonFiniteError(FloatingPointError):
    """Raised by ``NonFiniteGuard(action="raise")``; ``finding`` holds the report as data (``None`` on a rank that
    found nothing itself when another rank did, under DDP)."""

    def __init__(self, message: str, finding: Finding | None) -> None:
        super().__init__(message)
        self.finding = finding


class NonFiniteGuard(HookCallback):
    """Name the first layer that made a NaN or an Inf, forward or backward, and stop, warn or skip the step.

    Every ``check_every_n_steps``-th optimizer step, from step 0, is checked in ``on_before_optimizer_step``
    (after AMP unscaling and DDP's all-reduce), before the weights change. The report names, forward first:
    the first module, in the order calls finish, whose output holds a NaN while its inputs hold none, or an
    Inf while its inputs are finite (its class, output path, count of bad values and input ranges); else a
    non-finite loss; else the first module whose input gradient turned non-finite while its output gradients
    were finite; and every parameter whose gradient is non-finite, with the step and batch index.

    ``mode="replay"`` hooks nothing on a healthy step and only checks that its losses and gradients are
    finite; a step that fails is replayed through ``training_step`` with the hooks on, changing no ``.grad``,
    generator, train/eval flag or buffer, and dropping its ``self.log`` calls. ``mode="eager"`` hooks every
    checked step and also sees NaNs that never reach the loss or the gradients (an Inf that never does is a
    mask, such as ``-inf`` logits of invalid actions, and is left alone). Manual optimization,
    ``training_step(dataloader_iter)`` and distributed strategies other than DDP and ``ModelParallelStrategy``
    use ``mode="eager"`` and say so once. Under several processes the ranks agree on the verdict (under
    ``ModelParallelStrategy``, where each holds its part of the gradients, in one all-reduce per checked step)
    and on the report, which names the rank.

    ``raise`` logs the report, flushes the logger and raises :class:`NonFiniteError`; ``warn`` logs every
    finding and warns once per layer; ``skip_step`` does what ``warn`` does and sets the optimizer's gradients
    to ``None``, so that its step changes neither the weights nor its state.

    The check reads one flag a step on the host, which waits for the device there; except where the optimizer can
    skip its step on the device (those that take a ``GradScaler``'s ``found_inf``: Adam, AdamW and SGD with
    ``fused=True``), under ``mode="replay"`` with ``raise`` or ``skip_step``, without a ``GradScaler`` or
    ``ModelParallelStrategy``. There the optimizer is handed the flag and skips a failed step itself, and the flag
    is read one optimizer step later (or at the end of training), when the device is long past it: the report,
    replay and action come then, for the failed step, whose weights the skip kept.

    Logged: text ``nonfinite/first_layer`` (the report, at each finding) and scalar
    ``nonfinite/skipped_steps`` (the running count of skipped steps).

    .. warning::
        * With a ``GradScaler``, backward and parameter findings are reported only when the scaler
          will take the step; forward findings always, saying that a scaler is active.
        * In-place ops outside modules (``out += identity``) are seen as made by the enclosing module.
        * Modules whose outputs are meant to be infinite (a ``-inf`` mask) are findings: ``exclude`` them.
        * A replay runs the Python side effects of ``training_step`` (counters, metric updates) again.

    Args:
        check_every_n_steps: Check every this many optimizer steps, from step 0.
        action: ``"raise"``, ``"warn"`` or ``"skip_step"``.
        check_backward: Also check gradients (module inputs and outputs, and parameters). Without,
            a NaN gradient is seen one checked step later, as NaN made by the layer it reached.
        include: Glob patterns over qualified module names (``""`` is the LightningModule).
        exclude: Glob patterns of modules to leave out.
        types: Class names of modules to watch, matched along the class hierarchy.
        max_depth: Watch modules at most this many levels below the LightningModule.
        mode: ``"replay"``: a finiteness check on every checked step, hooks only to replay a step that
            failed it. ``"eager"``: hooks on every checked step.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_hooks import NonFiniteGuard
        >>> trainer = Trainer(callbacks=[NonFiniteGuard(action="skip_step")], logger=False)
    """

    def __init__(
        self,
        check_every_n_steps: int = 1,
        action: Action = "raise",
        check_backward: bool = True,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        types: list[str] | None = None,
        max_depth: int | None = None,
        mode: Mode = "replay",
    ) -> None:
        owner = type(self).__name__
        _validate.positive_int(owner, "check_every_n_steps", check_every_n_steps, allow_none=False)
        _validate.choice(owner, "action", action, ACTIONS)
        _validate.boolean(owner, "check_backward", check_backward)
        _validate.choice(owner, "mode", mode, MODES)
        super().__init__(
            log_every_n_steps=check_every_n_steps, include=include, exclude=exclude, types=types, max_depth=max_depth
        )
        self.check_every_n_steps, self.action, self.check_backward = check_every_n_steps, action, check_backward
        self.mode = mode
        self.skipped_steps = 0
        self.last_finding: Finding | None = None
        """The latest finding of the current (or last) fit, ``None`` until there is one (read by ``HealthMonitor``)."""
        self._recorder = NonFiniteRecorder(check_backward)
        self._eager = mode == "eager"
        self._micro_batches: list[MicroBatch] = []
        self._every_module: list[nn.Module] = []
        self._device = torch.device("cpu")
        self._distributed = False
        self._sharded = False
        """Under ``ModelParallelStrategy``: each rank holds its own part of the gradients, so the ranks agree on a
        step's verdict with a collective."""
        self._skipping = False
        self._warned: set[str] = set()
        self._scaler: torch.amp.GradScaler | None = None
        self._param_names: dict[int, str] = {}
        self._compiled = False
        self._verdict: _Verdict | None = None
        """A checked step whose optimizer skips it on the device if its flag is set, judged one optimizer step later."""

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[tuple[str, nn.Module]]) -> None:
        self._scaler = loss_scaler(trainer)
        self._param_names = {id(p): name for name, p in named_parameters(pl_module)}
        self._warned = set()
        self.skipped_steps = 0
        self.last_finding = None
        self._eager = self.mode == "eager"
        self._every_module = list(pl_module.modules())
        self._compiled = has_compiled(pl_module, modules)
        self._device, self._distributed = trainer.strategy.root_device, trainer.world_size > 1
        self._sharded = self._distributed and isinstance(trainer.strategy, ModelParallelStrategy)
        if not self._eager:
            why = _cannot_replay(trainer, pl_module)
            if why:
                self._eager = True
                rank_zero_warn(f"`NonFiniteGuard` uses `mode='eager'` (hooks on every checked step): {why}.")

    @override
    def _detach(self) -> None:
        super()._detach()
        self._disarm()
        self._param_names = {}
        self._every_module = []

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_every_module": [], "_micro_batches": [], "_verdict": None}

    def _disarm(self) -> None:
        self._take_back()
        self._verdict = None
        run_eager(self, False)
        self.gate.reset()
        self._skipping = False
        self._recorder.active = False
        self._recorder.clear()
        self._micro_batches = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        opening = not self.gate.is_open
        if opening:
            step = self.due_step(trainer)
            if step is None:
                return
            self.gate.begin(step, due=True)
        if not self._eager:
            start = RngState.capture(self._device), training_flags(self._every_module)
            self._micro_batches.append(MicroBatch(batch, batch_idx, *start))
            return
        if opening:
            self._recorder.clear()
        self._recorder.batch_idx = batch_idx
        self._recorder.active = True
        run_eager(self, self._compiled)
        if not len(self._step_handles):  # still on when the previous step was checked too
            self._recorder.attach(self._modules, self._step_handles)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if not self.gate.is_open:
            return
        if self._eager:
            self._recorder.record_loss(loss)
        elif self._micro_batches:
            self._micro_batches[-1].loss = loss.detach()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._verdict is not None:  # the step before's flag has long reached the host
            self._judge(trainer, pl_module)
        if self.gate.step is None:
            return
        if self._skipping:
            optimizer.zero_grad(set_to_none=True)
            return
        if self._eager:
            self._check(trainer, optimizer, self.gate.step)
        else:
            self._sentinel(trainer, pl_module, optimizer, self.gate.step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._take_back()
        if not self._eager:
            if self.gate.is_open and self.gate.end(trainer.global_step) is not None:
                self._micro_batches, self._skipping = [], False
            return
        self._recorder.active = False
        run_eager(self, False)
        step = self.gate.end(trainer.global_step, force=not pl_module.automatic_optimization)
        if step is not None:
            if len(self._recorder):
                self._check(trainer, None, step)
            self._disarm()
        if not self.gate.is_open and self.due_step(trainer) is None:
            self._step_handles.remove()

    def _sentinel(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer, step: int) -> None:
        """Replay mode: check the step; if it failed, read what the check saw, replay it, agree across ranks, act."""
        found_inf = overflow_flags(self._scaler, optimizer)
        grads = [] if found_inf else _strided_gradients(optimizer)
        losses = [m.loss for m in self._micro_batches if m.loss is not None]
        # Under DDP the all-reduced gradients decide, so that every rank reaches the same verdict; where each rank
        # holds its own part of them (FSDP2, tensor parallelism), the ranks agree on it in one collective.
        deciding = losses if not self._distributed or self._sharded else []
        if self._skips_on_device(optimizer, grads, deciding):
            flag = nonfinite_flag(grads, deciding)
            optimizer.found_inf = flag  # type: ignore[attr-defined]  # read by the fused step, as a GradScaler's is
            self._verdict = _Verdict(step, *_on_host(flag), self._micro_batches, optimizer)
            return
        finite = finite_step(grads, deciding, found_inf)
        if self._sharded:
            finite = trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            self._diagnose(trainer, pl_module, step, self._micro_batches, optimizer, found_inf)

    def _skips_on_device(self, optimizer: Optimizer, grads: list[torch.Tensor], losses: list[torch.Tensor]) -> bool:
        """Whether ``optimizer`` can be handed this step's flag, to skip the step itself if it is set."""
        return (
            self.action != "warn"  # `warn` lets a failed step change the weights
            and self._scaler is None
            and not self._sharded
            and bool(getattr(optimizer, "_step_supports_amp_scaling", False))  # fused Adam, AdamW, SGD
            and not hasattr(optimizer, "found_inf")
            and len({t.device for t in (*grads, *losses)}) == 1
        )

    def _judge(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Read the flag the optimizer was handed; if it was set, that step was skipped (or is to raise): report it."""
        verdict, self._verdict = self._verdict, None
        assert verdict is not None
        if verdict.ready is not None:
            verdict.ready.synchronize()  # long done: the device has computed a step since
        if verdict.flag.tolist():
            self._diagnose(trainer, pl_module, verdict.step, verdict.micro_batches, verdict.optimizer, [], handed=True)

    def _take_back(self) -> None:
        """Remove the flag handed to the optimizer, once its step is taken (or the fit ends)."""
        if self._verdict is not None and hasattr(self._verdict.optimizer, "found_inf"):
            del self._verdict.optimizer.found_inf

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back()
        if self._verdict is not None:  # the last step's
            self._judge(trainer, pl_module)
        super().on_train_end(trainer, pl_module)

    def _diagnose(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        micro_batches: list[MicroBatch],
        optimizer: Optimizer,
        found_inf: list[torch.Tensor],
        handed: bool = False,
    ) -> None:
        """A failed step: read what the check saw, replay the step, agree across ranks and act. ``handed``: the
        optimizer was handed the flag and skipped the step; its gradients are gone, the replay takes them again."""
        losses = [(m.batch_idx, m.loss) for m in micro_batches if m.loss is not None]
        scaler_skips = bool(found_inf and sum(map(float, found_inf)))
        named = self._gradients(optimizer) if self.check_backward and not handed else []
        seen = [*(n.float() for n in grad_readings(named)), *(loss.float() for _, loss in losses)]
        values = torch.stack(seen).tolist() if seen else []
        parameters = parameter_readings(named, values[: len(named)])
        bad_losses = [(i, v) for (i, _), v in zip(losses, values[len(named) :], strict=True) if not math.isfinite(v)]
        weights = self._weights(optimizer) if self.check_backward and handed else []
        replayed = self._replay(trainer, pl_module, micro_batches, self.check_backward and not scaler_skips, weights)
        if replayed is None and bad_losses:
            batch_idx, value = bad_losses[0]
            replayed = Finding("loss", tensor=("", Reading(value, value, 1, 1)), batch_idx=batch_idx, reproduced=False)
        if scaler_skips:
            local = replayed if replayed is not None and replayed.phase in ("forward", "loss") else None
        else:
            local = with_parameters(replayed, parameters)
        if local is not None:
            local = replace(local, step=step, replayed=True)
        finding = self._agree(trainer, local)
        if finding is not None:
            self._act(trainer, finding, None if handed else optimizer, scaler_skips, step, skipped=handed)

    def _replay(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        micro_batches: list[MicroBatch],
        backward: bool,
        weights: list[tuple[str, torch.Tensor]],
    ) -> Finding | None:
        training_step = pl_module.training_step
        takes_batch_idx = is_param_in_hook_signature(training_step, "batch_idx", min_args=2)

        def run(micro: MicroBatch) -> torch.Tensor | None:
            output = training_step(micro.batch, micro.batch_idx) if takes_batch_idx else training_step(micro.batch)
            loss = output.get("loss") if isinstance(output, Mapping) else output  # as Lightning reads it
            return loss if isinstance(loss, torch.Tensor) else None

        with _logging_dropped(pl_module), trainer.precision_plugin.train_step_context(), eager_stance():
            return replay(pl_module, self._modules, micro_batches, run, trainer.strategy.root_device, backward, weights)

    def _agree(self, trainer: pl.Trainer, local: Finding | None) -> Finding | None:
        """Every rank's finding, agreed with one ``all_gather_object`` (called by every rank at once)."""
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            return local
        gathered: list[Finding | None] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, local)
        return first_finding(gathered)

    def _check(self, trainer: pl.Trainer, optimizer: Optimizer | None, step: int) -> None:
        """Eager mode: read the step, decide, and act on what was found."""
        grads = self._gradients(optimizer) if self.check_backward and optimizer is not None else []
        finding, norms = self._recorder.find(grad_readings(grads))
        self._recorder.clear()
        parameters = parameter_readings(grads, norms)
        scaler_skips = self._scaler is not None and bool(parameters)
        if scaler_skips:
            finding = finding if finding is not None and finding.phase in ("forward", "loss") else None
        else:
            finding = with_parameters(finding, parameters)
        if finding is not None:
            finding = replace(finding, step=step)
        found = finding is not None
        # Under tensor parallelism a rank may see values go wrong that another made: the ranks always agree.
        if trainer.world_size > 1 and (self.action != "warn" or tensor_parallel_mesh(trainer) is not None):
            found = trainer.strategy.reduce_boolean_decision(found, all=False)
            if found:
                finding = self._agree(trainer, finding)
        if found:
            self._act(trainer, finding, optimizer, scaler_skips, step)

    def _weights(self, optimizer: Optimizer) -> list[tuple[str, torch.Tensor]]:
        params = (p for group in optimizer.param_groups for p in group["params"])
        return [(self._param_names.get(id(p), f"<parameter {i}>"), p) for i, p in enumerate(params)]

    def _gradients(self, optimizer: Optimizer) -> list[tuple[str, torch.Tensor]]:
        return [
            (name, local(p.grad))  # a DTensor's own shard (FSDP2)
            for name, p in self._weights(optimizer)
            if p.grad is not None and p.grad.layout == torch.strided
        ]

    def _act(
        self,
        trainer: pl.Trainer,
        finding: Finding | None,
        optimizer: Optimizer | None,
        scaler_skips: bool,
        step: int,
        skipped: bool = False,
    ) -> None:
        """Report and act; ``skipped``: the optimizer skipped the step on the device already."""
        if finding is None:
            lines = [f"another rank found NaN/Inf values at step {step}"]
        else:
            self.last_finding = finding
            lines = finding.lines(step)
            if self._scaler is not None:
                lines.append(self._scaler_note(finding, scaler_skips))
        skip = self.action == "skip_step" and (optimizer is not None or skipped)
        if skip:
            lines.append("the optimizer step is skipped")
        if finding is not None:
            self._sink.text(trainer, TEXT_TAG, "  \n".join(lines), step)
        report = f"`NonFiniteGuard` found NaN/Inf values at step {step}:\n" + "\n".join(lines)
        if self.action == "raise":
            self._sink.flush(trainer)
            raise NonFiniteError(report, finding)
        if skip:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
                self._skipping = True
            self.skipped_steps += 1
            self._sink.scalars(trainer, {SKIPPED_TAG: float(self.skipped_steps)}, step)
        if finding is not None and (key := f"{finding.phase}:{finding.layer}") not in self._warned:
            self._warned.add(key)
            rank_zero_warn(
                f"{report}\n(Not warned again for `{finding.layer}` ({finding.phase}); every finding is logged to "
                f"TensorBoard text `{TEXT_TAG}`.)"
            )

    def _scaler_note(self, finding: Finding, scaler_skips: bool) -> str:
        scale = self._scaler.get_scale() if self._scaler is not None else math.nan
        if finding.phase in ("forward", "loss"):
            skips = "will skip this step and lower its scale" if scaler_skips else "will not skip this step"
            return (
                f"a GradScaler is active (scale {scale:g}) and {skips}; forward values do not depend on the scale, "
                f"so this is not a scale-search artefact (an fp16 overflow? `bf16-mixed` has the range of fp32)"
            )
        return (
            f"a GradScaler is active (scale {scale:g}) but found the parameter gradients finite: it will take this step"
        )


@dataclass
class _Verdict:
    """A checked step whose flag the optimizer was handed: ``flag`` is on the host once ``ready`` is done."""

    step: int
    flag: torch.Tensor
    ready: torch.Event | None
    micro_batches: list[MicroBatch]
    optimizer: Optimizer


def _on_host(flag: torch.Tensor) -> tuple[torch.Tensor, torch.Event | None]:
    """A copy of the accelerator's ``flag`` on its way to (pinned) host memory, and the event that says it is there."""
    if flag.device.type == "cpu":
        return flag, None
    host = torch.empty_like(flag, device="cpu", pin_memory=flag.device.type == "cuda")
    host.copy_(flag, non_blocking=True)
    ready = torch.Event(device=flag.device)
    ready.record()
    return host, ready


def _cannot_replay(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
    """Why this fit cannot be replayed (empty if it can)."""
    if not pl_module.automatic_optimization:
        return "with manual optimization, replaying `training_step` would step the optimizer again"
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        return "a `training_step(dataloader_iter)` takes its own batches, which cannot be replayed"
    strategy = trainer.strategy
    if trainer.world_size > 1 and not (
        isinstance(strategy, ModelParallelStrategy)
        or (isinstance(strategy, DDPStrategy) and getattr(strategy, "strategy_name", "ddp") not in ("deepspeed", "xla"))
    ):
        return (
            f"under `{type(strategy).__name__}` the ranks' gradients are not all-reduced copies, so they would not "
            f"agree on a step's verdict without a collective"
        )
    return ""


def _strided_gradients(optimizer: Optimizer) -> list[torch.Tensor]:
    """The dense gradients of ``optimizer``'s parameters (this process's part of a ``DTensor``'s)."""
    return [
        local(grad)
        for group in optimizer.param_groups
        for p in group["params"]
        if (grad := p.grad) is not None and grad.layout == torch.strided
    ]


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """``LightningModule.log`` during a replay: the step already logged its values once."""


@contextmanager
def _logging_dropped(pl_module: pl.LightningModule) -> Iterator[None]:
    """Make ``self.log`` and ``self.log_dict`` (which calls it) do nothing, for this module only."""
    own = pl_module.__dict__.get("log")
    pl_module.log = _drop_log  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log
        if own is not None:
            pl_module.log = own  # type: ignore[method-assign]

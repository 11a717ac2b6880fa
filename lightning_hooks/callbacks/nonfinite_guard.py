"""NonFiniteGuard: name the first layer that made a NaN or an Inf, forward or backward."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.base import HookCallback, loss_scaler
from lightning_hooks.core import validate as _validate
from lightning_hooks.core.compiled import eager_stance, has_compiled, run_eager
from lightning_hooks.core.select import named_parameters
from lightning_hooks.core.shards import local
from lightning_hooks.diagnose.finding import Finding, Reading, first_finding, with_parameters
from lightning_hooks.diagnose.replay import MicroBatch, RngState, replay, training_flags
from lightning_hooks.recorders.finite import NonFiniteRecorder, finite_step, grad_readings, parameter_readings

if TYPE_CHECKING:
    import lightning.pytorch as pl

Action = Literal["raise", "warn", "skip_step"]
ACTIONS: tuple[Action, ...] = ("raise", "warn", "skip_step")
Mode = Literal["replay", "eager"]
MODES: tuple[Mode, ...] = ("replay", "eager")
TEXT_TAG = "nonfinite/first_layer"
SKIPPED_TAG = "nonfinite/skipped_steps"


class NonFiniteError(FloatingPointError):
    """Raised by ``NonFiniteGuard(action="raise")``; ``finding`` holds the report as data.

    ``finding`` is ``None`` on a rank that found nothing itself when another rank did (DDP).
    """

    def __init__(self, message: str, finding: Finding | None) -> None:
        super().__init__(message)
        self.finding = finding


class NonFiniteGuard(HookCallback):
    """Name the first layer that made a NaN or an Inf, forward or backward, and stop, warn or skip the step.

    A far cheaper ``torch.autograd.detect_anomaly`` that also watches forward, in one of two modes.

    **mode="replay"** (the default): free on healthy steps, exact on the step that goes bad.
    On each checked optimizer step (every ``check_every_n_steps``-th, from step 0) no hook is
    attached; a *sentinel* checks the step in ``on_before_optimizer_step`` (after AMP unscaling
    and after DDP's all-reduce of the gradients): one on-device reduction of the parameter
    gradients (:func:`~lightning_hooks.recorders.finite.finite_step`) with the losses of the step's
    micro-batches, read with one host transfer. Under a ``GradScaler`` its own ``found_inf`` stands for the gradients.
    All the sentinel keeps meanwhile is a reference to each micro-batch (never a copy), the
    random-number-generator states (CPU, and the accelerator's) and the train/eval flags each
    started with. When it fires, before the optimizer has changed anything, the step's
    micro-batches are *replayed*: ``training_step`` runs again on the same batch objects from
    the same generator and train/eval states, under the precision plugin's autocast, with the
    hooks of ``mode="eager"`` attached, and each loss is differentiated with respect to the
    recorded activations only (``torch.autograd.grad``), so that no parameter's ``.grad``
    changes and DDP's reducer does not fire. The generators, train/eval flags and buffers
    (batch-norm running statistics) are put back afterwards, and ``self.log`` calls made by the
    replayed ``training_step`` are dropped: nothing is logged twice. If the replay finds every
    value finite although the step's loss was not (a non-deterministic kernel, a batch that
    ``training_step`` changes in place), the report says so and names what the sentinel saw.
    Manual optimization, where replaying ``training_step`` would step the optimizer again, a
    ``training_step(dataloader_iter)``, and distributed strategies other than DDP use
    ``mode="eager"`` and say so once.

    **mode="eager"**: on a checked step, all micro-batches of it, each selected module gets a
    forward pre-hook and a forward hook, removed when the step ends unless the next step is
    checked too (then they stay, switched off between batches); on steps that are not checked
    nothing is attached and nothing is computed. It reads every activation of every checked
    step, and catches what never reaches the loss
    or the gradients (a NaN in a branch masked out by ``torch.where``), which the replay's
    sentinel cannot see.

    **torch.compile.** Compiled code does not call hooks attached after it was compiled: the
    replay, and the checked batches of ``mode="eager"`` when selected modules are inside a
    compiled region, run the compiled code eagerly (``torch.compiler.set_stance("force_eager")``)
    so that the hooks fire. The sentinel of a healthy step runs outside the graphs and changes
    nothing in them.

    **What the hooks see.** The pre-hook reduces each floating-point input of a call to its
    minimum and maximum on the device (one ``torch.aminmax`` kernel; NaN propagates into both, an
    Inf shows in one), the forward hook does the same for each output, nested ones included. A
    tensor already measured in the step and not changed since (an output that is the next
    layer's input) is not measured again. With ``check_backward``, a tensor hook on each of those
    tensors that requires grad measures its gradient in backward; the hook on an input is put on
    in the pre-hook, so it sees the gradient with respect to the value the module was *given*
    even when the module then modifies it in place (``ReLU(inplace=True)``), which
    ``register_full_backward_hook`` cannot do. Nothing reaches the host until the checked step
    ends: in ``on_before_optimizer_step`` (after AMP unscaling, before gradient clipping and the
    optimizer step) every reading, the loss and one fused reading of all of the optimizer's
    parameter gradients cross in one transfer.

    **What it reports**, forward first, since a NaN loss makes every gradient NaN:

    * forward: the first call, in the order calls *finish*, whose output holds a NaN while its
      inputs hold none, or an Inf while its inputs are finite: its qualified name and class, the
      output's path inside a nested output, how many values are bad, and the range of each input.
      Containers finish after their children, so the leaf that made the value is named, not the
      containers that pass it on; a container is named when its own code made it (``torch.log``
      in its ``forward``). An Inf coming in (a ``-inf`` attention mask) does not excuse a NaN
      going out: the module that turns a fully masked row into NaN is named.
    * loss: all outputs finite but the loss is not.
    * backward: the first gradient, in the order autograd computes them, that is non-finite at
      a module's input while the gradients at its outputs were finite; an input several modules
      share gets the sum of their gradients, so all of them are named.
    * every parameter of the optimizer whose gradient is non-finite, selected module or not (a
      NaN anywhere would reach the weights), and the step and batch index.
    * where nothing made them, where non-finite values first came in (the batch, the loss).

    **Actions.** ``raise``: logs the report to TensorBoard text ``nonfinite/first_layer``,
    flushes the logger and raises :class:`NonFiniteError` (a ``FloatingPointError``) before the
    weights change; Lightning then calls ``on_exception``, which removes every hook. ``warn``:
    logs the report at every finding and warns once per layer. ``skip_step``: does what ``warn``
    does, sets every gradient of the optimizer to ``None`` so that its step changes neither the
    weights nor its state (momentum, Adam moments, step counts; zeros would still move them),
    and logs the running count ``nonfinite/skipped_steps``. A step found bad in a batch without
    an optimizer step (manual optimization) cannot be skipped; it is reported.

    .. warning::
        * **AMP with a GradScaler**: during the scale search, Inf gradients are normal and the
          scaler skips those steps itself, so backward and parameter findings are reported only
          when the scaler will take the step. Forward findings are always reported, saying that
          a scaler is active: the forward pass does not depend on the scale (an fp16 overflow in
          forward makes the scaler skip every step; ``bf16-mixed`` avoids it). In replay mode
          each step the scaler skips is replayed (forward only) to look for such a finding.
        * **In-place ops outside modules** (``out += identity`` in a ``forward``) are seen as
          made by the enclosing module; a module that creates a NaN *in place* in its input is
          seen the same way.
        * **Modules whose outputs are meant to be infinite** (one that builds a ``-inf`` mask)
          are findings: leave them out with ``exclude``.
        * **What a replay runs twice**: Python side effects of ``training_step`` (counters, a
          ``torchmetrics`` metric updated there) happen again on the replayed step; the hooks of
          this package's other callbacks sleep through it.
        * **DDP**: in replay mode the sentinel reads the all-reduced gradients, so every rank
          reaches the same verdict without a collective (a loss that is non-finite on one rank
          only counts through the gradients it makes); each rank replays its own micro-batches,
          and on a failing step only the ranks agree on the report with one
          ``all_gather_object``: every rank raises or skips, and the report names the rank. In
          eager mode ranks agree (one small all-reduce per checked step) on whether to raise or
          skip.

    Args:
        check_every_n_steps: Check every this many optimizer steps, from step 0.
        action: ``"raise"``, ``"warn"`` or ``"skip_step"``.
        check_backward: Also check gradients (module inputs and outputs, and parameters). Without,
            a NaN gradient is seen one checked step later, as NaN made by the layer it reached.
        include: Glob patterns over qualified module names (``""`` is the LightningModule).
        exclude: Glob patterns of modules to leave out.
        types: Class names of modules to watch, matched along the class hierarchy.
        max_depth: Watch modules at most this many levels below the LightningModule.
        mode: ``"replay"``: a sentinel on every checked step, hooks only to replay a step that
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
        self._skipping = False
        self._warned: set[str] = set()
        self._scaler: torch.amp.GradScaler | None = None
        self._param_names: dict[int, str] = {}
        self._compiled = False
        """Whether some selected module is inside a compiled region (eager mode runs checked batches eagerly)."""

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
        # Neither the model's modules nor a step's batches travel with a copy of the callback.
        return {**super().__getstate__(), "_every_module": [], "_micro_batches": []}

    def _disarm(self) -> None:
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
        if not self._eager:  # the sentinel: keep what a replay would need, attach nothing
            start = RngState.capture(self._device), training_flags(self._every_module)
            self._micro_batches.append(MicroBatch(batch, batch_idx, *start))
            return
        if opening:
            self._recorder.clear()
        self._recorder.batch_idx = batch_idx
        self._recorder.active = True
        run_eager(self, self._compiled)  # compiled code would not call hooks attached now
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
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.gate.step is None:
            return
        if self._skipping:  # a further optimizer of a step already found bad
            _drop_gradients(optimizer)
            return
        if self._eager:
            self._check(trainer, optimizer, self.gate.step)
        else:
            self._sentinel(trainer, pl_module, optimizer, self.gate.step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._eager:
            if self.gate.is_open and self.gate.end(trainer.global_step) is not None:  # the step is over
                self._micro_batches, self._skipping = [], False
            return
        self._recorder.active = False  # what runs until the next batch (validation) is not recorded
        run_eager(self, False)
        # The checked step is over once the optimizer stepped (after every batch in manual optimization).
        step = self.gate.end(trainer.global_step, force=not pl_module.automatic_optimization)
        if step is not None:
            if len(self._recorder):  # recorded after the last optimizer step (manual optimization)
                self._check(trainer, None, step)
            self._disarm()
        if not self.gate.is_open and not self.is_logging_step(trainer):  # kept while the next step is checked
            self._step_handles.remove()

    def _sentinel(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer, step: int
    ) -> None:
        """Replay mode: one on-device check of the step, one transfer; replay and act only if it failed."""
        found_inf = self._found_inf(optimizer)
        grads = [] if found_inf else _strided_gradients(optimizer)
        # Each rank's own losses would give each rank its own verdict: under DDP the all-reduced gradients decide.
        losses = [] if self._distributed else [m.loss for m in self._micro_batches if m.loss is not None]
        if finite_step(grads, losses, found_inf):  # the one host transfer of a healthy step
            return
        self._failed(trainer, pl_module, optimizer, step, scaler_skips=bool(found_inf and sum(map(float, found_inf))))

    def _failed(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: torch.optim.Optimizer,
        step: int,
        scaler_skips: bool,
    ) -> None:
        """The sentinel fired: read what it saw, replay the step, agree across ranks, act."""
        named = self._gradients(optimizer) if self.check_backward else []
        losses = [(m.batch_idx, m.loss) for m in self._micro_batches if m.loss is not None]
        seen = [*(n.float() for n in grad_readings(named)), *(loss.float() for _, loss in losses)]
        values = torch.stack(seen).tolist() if seen else []  # a second transfer, on a failing step only
        parameters = parameter_readings(named, values[: len(named)])
        bad_losses = [(i, v) for (i, _), v in zip(losses, values[len(named) :], strict=True) if not math.isfinite(v)]
        replayed = self._replay(trainer, pl_module, backward=self.check_backward and not scaler_skips)
        if replayed is None and bad_losses:
            batch_idx, value = bad_losses[0]
            replayed = Finding("loss", tensor=("", Reading(value, value, 1, 1)), batch_idx=batch_idx, reproduced=False)
        if scaler_skips:  # the scaler's own business, unless forward values were bad
            local = replayed if replayed is not None and replayed.phase in ("forward", "loss") else None
        else:
            local = with_parameters(replayed, parameters)
        if local is not None:
            local = replace(local, step=step, replayed=True)
        finding = self._agree(trainer, local)
        if finding is not None:
            self._act(trainer, finding, optimizer, scaler_skips, step)

    def _replay(self, trainer: pl.Trainer, pl_module: pl.LightningModule, backward: bool) -> Finding | None:
        training_step = pl_module.training_step  # the LightningModule's own: DDP's wrapper is not called
        takes_batch_idx = is_param_in_hook_signature(training_step, "batch_idx", min_args=2)

        def run(micro: MicroBatch) -> torch.Tensor | None:
            args = (micro.batch, micro.batch_idx) if takes_batch_idx else (micro.batch,)
            return _loss_of(training_step(*args))

        # Compiled regions run eagerly in the replay, so that the recorder's hooks fire there.
        with _logging_dropped(pl_module), trainer.precision_plugin.train_step_context(), eager_stance():
            return replay(
                pl_module, self._modules, self._micro_batches, run, trainer.strategy.root_device, backward=backward
            )

    def _agree(self, trainer: pl.Trainer, local: Finding | None) -> Finding | None:
        """Every rank's finding, agreed with one ``all_gather_object`` (called by every rank at once)."""
        if trainer.world_size == 1 or not torch.distributed.is_initialized():
            return local
        gathered: list[Finding | None] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, local)
        return first_finding(gathered)

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The ``found_inf`` flags the GradScaler computed when it unscaled ``optimizer``'s gradients."""
        if self._scaler is None:
            return []
        state = self._scaler._per_optimizer_states.get(id(optimizer), {})
        return list(state.get("found_inf_per_device", {}).values())

    def _check(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Eager mode: read the step (one transfer), decide, and act on what was found."""
        grads = self._gradients(optimizer) if self.check_backward and optimizer is not None else []
        finding, norms = self._recorder.find(grad_readings(grads))
        self._recorder.clear()
        parameters = parameter_readings(grads, norms)
        scaler_skips = self._scaler is not None and bool(parameters)
        if scaler_skips:  # the scaler's own business: it skips the step and lowers its scale
            finding = finding if finding is not None and finding.phase in ("forward", "loss") else None
        else:
            finding = with_parameters(finding, parameters)
        if finding is not None:
            finding = replace(finding, step=step)
        found = finding is not None
        if trainer.world_size > 1 and self.action != "warn":
            found = trainer.strategy.reduce_boolean_decision(found, all=False)
            if found:  # every rank knows: they can agree on the report
                finding = self._agree(trainer, finding)
        if found:
            self._act(trainer, finding, optimizer, scaler_skips, step)

    def _gradients(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        return [
            (self._param_names.get(id(p), f"<parameter {i}>"), local(p.grad))  # a DTensor's own shard (FSDP2)
            for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
            if p.grad is not None and p.grad.layout == torch.strided
        ]

    def _act(
        self,
        trainer: pl.Trainer,
        finding: Finding | None,
        optimizer: torch.optim.Optimizer | None,
        scaler_skips: bool,
        step: int,
    ) -> None:
        if finding is None:
            lines = [f"another rank found NaN/Inf values at step {step}"]
        else:
            self.last_finding = finding
            lines = finding.lines(step)
            if self._scaler is not None:
                lines.append(self._scaler_note(finding, scaler_skips))
        skip = self.action == "skip_step" and optimizer is not None
        if skip:
            lines.append("the optimizer step is skipped")
        if finding is not None:
            self._sink.text(trainer, TEXT_TAG, "  \n".join(lines), step)
        if self.action == "raise":
            self._sink.flush(trainer)
            raise NonFiniteError(f"`NonFiniteGuard` found NaN/Inf values at step {step}:\n" + "\n".join(lines), finding)
        if skip and optimizer is not None:
            _drop_gradients(optimizer)
            self._skipping = True
            self.skipped_steps += 1
            self._sink.scalars(trainer, {SKIPPED_TAG: float(self.skipped_steps)}, step)
        key = f"{finding.phase}:{finding.layer}" if finding is not None else ""
        if finding is not None and key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(
                f"`NonFiniteGuard` found NaN/Inf values at step {step}:\n"
                + "\n".join(lines)
                + f"\n(Not warned again for `{finding.layer}` ({finding.phase}); every finding is logged to "
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


def _drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Make the coming optimizer step a no-op: optimizers skip parameters whose ``grad`` is ``None``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _cannot_replay(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
    """Why this fit cannot be replayed (empty if it can)."""
    if not pl_module.automatic_optimization:
        return "with manual optimization, replaying `training_step` would step the optimizer again"
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        return "a `training_step(dataloader_iter)` takes its own batches, which cannot be replayed"
    strategy = trainer.strategy
    if trainer.world_size > 1 and not (
        isinstance(strategy, DDPStrategy) and getattr(strategy, "strategy_name", "ddp") not in ("deepspeed", "xla")
    ):
        return (
            f"under `{type(strategy).__name__}` the ranks' gradients are not all-reduced copies, so they would not "
            f"agree on a step's verdict without a collective"
        )
    return ""


def _strided_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The dense gradients of ``optimizer``'s parameters: what the sentinel reads on every step."""
    return [
        grad
        for group in optimizer.param_groups
        for p in group["params"]
        if (grad := p.grad) is not None and grad.layout == torch.strided
    ]


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned, as Lightning reads it."""
    if isinstance(output, Mapping):
        output = output.get("loss")
    return output if isinstance(output, torch.Tensor) else None


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """``LightningModule.log`` during a replay: the step already logged its values once."""


@contextmanager
def _logging_dropped(pl_module: pl.LightningModule) -> Iterator[None]:
    """Make ``self.log`` and ``self.log_dict`` (which calls it) do nothing, for this module only."""
    own = pl_module.__dict__.get("log")  # an instance attribute of the user's, if any, comes back
    pl_module.log = _drop_log  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del pl_module.log
        else:
            pl_module.log = own  # type: ignore[method-assign]

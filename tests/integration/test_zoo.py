"""Every callback at once on every zoo model, in a real fit: nothing crashes, what is logged is right."""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from lightning_hooks import (
    ActivationStats,
    GradClamp,
    GradStats,
    HealthMonitor,
    NonFiniteGuard,
    ShapeLogger,
    trace_shapes,
)
from lightning_hooks.core.nested import named_tensors
from lightning_hooks.core.select import label
from lightning_hooks.recorders.shapes import format_markdown
from tests.support.helpers import events, hook_state, make_trainer, scalars, texts
from tests.support.pretrained import THIRD_PARTY, third_party
from tests.support.zoo import ZOO, AttentionNet, CheckpointNet, TransformerNet, ZooModule


def every_callback() -> list[pl.Callback]:
    return [ShapeLogger(), GradClamp(0.5), GradStats(log_every_n_steps=1), ActivationStats(log_every_n_steps=1)]


def fit(model: ZooModule, root: Path) -> list[str]:
    """Fit two steps with every callback; return the warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(root, every_callback(), max_steps=2, log_every_n_steps=1).fit(model)
    return [str(w.message) for w in caught if "lightning_hooks" in w.filename or "`" in str(w.message)]


@pytest.mark.parametrize("model_class", ZOO, ids=lambda c: c.__name__)
def test_every_callback_on_every_model(tmp_path: Path, model_class: type[ZooModule]) -> None:
    torch.manual_seed(0)
    model = model_class()
    initial = copy.deepcopy(model)
    before = hook_state(model)
    messages = fit(model, tmp_path)

    assert hook_state(model) == before
    assert all(n == 1 for n in Counter(messages).values()), f"a warning repeated: {messages}"

    # The table is that of a plain forward with the same input.
    x = initial.x[: initial.batch_size]
    expected = format_markdown(trace_shapes(copy.deepcopy(initial), x, **initial.call_kwargs))
    assert texts(tmp_path, "shapes/train")[0].endswith(expected)

    # Statistics of the probe layer equal an independent computation on the first batch.
    outputs: list[torch.Tensor] = []
    probe = initial.get_submodule(initial.probe)
    probe.register_forward_hook(lambda m, a, out: outputs.append(named_tensors(out)[0][1].detach()))
    initial.train()
    initial.run(x)
    paths = [p for p, t in named_tensors_of(initial, x) if t.is_floating_point()]
    tag = label(initial.probe) + (f".out.{paths[0]}" if paths[0] else "")
    assert scalars(tmp_path, f"act_mean/{tag}")[0] == pytest.approx(
        float(outputs[0].double().mean()), rel=1e-4, abs=1e-6
    )

    # Every parameter that receives a gradient is reported, under its first name.
    initial.zero_grad()
    initial.training_step((x, initial.y[: initial.batch_size]), 0).backward()
    with_grad = {n for n, p in initial.named_parameters() if p.grad is not None}
    logged = events(tmp_path).Tags()["scalars"]
    assert {t.split("/", 1)[1] for t in logged if t.startswith("grad_norm/")} == with_grad


class Truth(pl.Callback):
    """Independent values, in float64, of each step: every module's first floating-point output, its calls pooled
    (sum and count), and every parameter's gradient norm when the optimizer is about to step."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[str, int], tuple[float, int]] = {}
        self.grad_norms: dict[tuple[str, int], float] = {}
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        for name, module in pl_module.named_modules():
            self.handles.append(module.register_forward_hook(self.note(name, trainer.global_step)))

    def note(self, name: str, step: int) -> object:
        def hook(module: nn.Module, args: object, output: object) -> None:
            found = [t for t in (output if isinstance(output, tuple) else (output,)) if torch.is_tensor(t)]
            if found and found[0].is_floating_point():
                t = found[0].detach().double()
                total, count = self.outputs.get((name, step), (0.0, 0))
                self.outputs[name, step] = (total + float(t.sum()), count + t.numel())

        return hook

    def on_train_batch_end(self, *args: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: object) -> None:
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                self.grad_norms[name, trainer.global_step] = float(p.grad.double().norm())


@pytest.mark.parametrize("kind", THIRD_PARTY)
def test_third_party_statistics_equal_an_independent_computation(tmp_path: Path, kind: str) -> None:
    # transformers' GPT-2, Llama, Mixtral, T5 (modules called several times), ViT, Whisper, BERT, ResNet, SegFormer,
    # and a peft LoRA GPT-2.
    truth = Truth()
    callbacks = [ActivationStats(log_every_n_steps=1), GradStats(log_every_n_steps=1), truth]
    make_trainer(tmp_path, callbacks, max_steps=2, log_every_n_steps=1).fit(third_party(kind))
    logged = events(tmp_path)
    compared = 0
    for tag in logged.Tags()["scalars"]:
        kind_, _, name = tag.partition("/")
        for event in logged.Scalars(tag):
            module, _, output = name.partition(".out.")
            if kind_ == "act_mean" and output in ("", "0"):  # the module's tensor or the first of its tuple
                total, count = truth.outputs[module, event.step]
                assert event.value == pytest.approx(total / count, rel=1e-4, abs=1e-6), (tag, event.step)
                compared += 1
            elif kind_ == "grad_norm":
                assert event.value == pytest.approx(truth.grad_norms[name, event.step], rel=1e-4), (tag, event.step)
                compared += 1
    assert compared > 40


def named_tensors_of(model: ZooModule, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    found: list[tuple[str, torch.Tensor]] = []
    handle = model.get_submodule(model.probe).register_forward_hook(lambda m, a, out: found.extend(named_tensors(out)))
    model.run(x)
    handle.remove()
    return found


@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpoint_recompute_is_not_counted_twice(tmp_path: Path, early_stop: bool) -> None:
    set_checkpoint_early_stop(early_stop)
    try:
        model = CheckpointNet()
        initial = copy.deepcopy(model)
        fit(model, tmp_path)
    finally:
        set_checkpoint_early_stop(True)
    table = texts(tmp_path, "shapes/train")[0]
    assert table.count("| block.0 |") == 1
    out = initial.block[0](initial.x[:8]).detach().double()
    assert scalars(tmp_path, "act_std/block.0")[0] == pytest.approx(float(out.std(correction=0)), rel=1e-5)


def test_the_never_ran_warning_comes_once_per_fit_not_once_per_process(tmp_path: Path) -> None:
    model = Bypassed()
    for run in ("first", "second"):  # the same model in a new Trainer is a new fit: the user is told again
        never = [m for m in fit(model, tmp_path / run) if "never ran" in m]
        assert len(never) == 1, run


class Routed(ZooModule):
    """No ``forward`` of its own (``training_step`` calls the layers, Lightning's pass-through ``forward`` is never
    called); ``late`` runs from step 3 on, like an expert the router picks late; ``spare`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.early, self.late, self.spare = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((self.late if self.global_step >= 3 else self.early)(x))


def test_never_ran_is_judged_over_the_whole_fit_once_for_every_callback(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callbacks = [ShapeLogger(), GradStats(), ActivationStats()]
        make_trainer(tmp_path, callbacks, max_steps=4, log_every_n_steps=1).fit(Routed())
    never = [str(w.message) for w in caught if "never ran" in str(w.message)]
    # Before: warned after step 0, naming `root` (the pass-through forward) and `late` (not yet routed), twice.
    assert len(never) == 1, never
    assert never[0].startswith("lightning_hooks (ShapeLogger, GradStats, ActivationStats): 1 selected module(s)")
    assert "nothing to show for them: spare." in never[0]


class Decoder(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed, self.layers = embed, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.dropout = nn.Dropout(0.1)  # applied by the attention kernel, never called

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).mean(1)
        for layer in self.layers:  # a Sequential iterated, never called
            x = torch.relu(layer(x))
        return x


class Bypassed(ZooModule):
    """What transformers models do: the decoder called past ``model`` (OPT), a ``Sequential`` iterated (ResNet), an
    embedding whose weight a module that runs also holds (BART's ``shared``), an attention dropout never called (BERT
    under SDPA). Nothing here goes unseen but ``unused``."""

    def __init__(self) -> None:
        super().__init__()
        self.x = torch.randint(0, 10, (32, 5), generator=torch.Generator().manual_seed(0))
        self.shared = nn.Embedding(10, 4)
        self.model = nn.Sequential()  # a model whose own forward its owner skips
        self.model.decoder = Decoder(nn.Embedding(10, 4))
        self.model.decoder.embed.weight = self.shared.weight
        self.head, self.unused = nn.Linear(4, 3), nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.model.decoder(tokens))


def test_modules_that_never_ran_but_whose_work_is_seen_are_not_named(tmp_path: Path) -> None:
    never = [m for m in fit(Bypassed(), tmp_path) if "never ran" in m]
    assert len(never) == 1, never
    assert "1 selected module(s)" in never[0]  # before: model, model.decoder.layers, model.decoder.dropout, shared too
    assert "nothing to show for them: unused." in never[0]


class FakeQuantized(nn.Module):
    """Quantization-aware training's usual wrapper: ``fc`` holds the weights, which this module rounds to a grid and
    applies itself (``fc`` is never called), the gradient passing straight through the rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.fc.weight + ((self.fc.weight * 16).round() / 16 - self.fc.weight).detach()
        return F.linear(x, weight, self.fc.bias)


class QuantizedNet(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.unused = FakeQuantized(), nn.Linear(4, 3), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_a_layer_whose_weights_its_parent_applies_is_not_named(tmp_path: Path) -> None:
    # Before, `body.fc` was named as never run, though its weights learn and GradStats logs their gradients.
    never = [m for m in fit(QuantizedNet(), tmp_path) if "never ran" in m]
    assert len(never) == 1, never
    assert "nothing to show for them: unused." in never[0]
    assert {"grad_norm/body.fc.weight", "act_mean/body"} <= set(events(tmp_path).Tags()["scalars"])


class StackNet(ZooModule):
    """Blocks kept in an ``nn.ModuleList`` and ``nn.ModuleDict``, which are iterated, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.heads = nn.ModuleDict({"out": nn.Linear(4, 3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.heads["out"](x)


def test_containers_without_a_forward_are_not_called_silent(tmp_path: Path) -> None:
    messages = fit(StackNet(), tmp_path)
    assert not [m for m in messages if "never ran" in m], messages
    assert "act_mean/blocks.1" in events(tmp_path).Tags()["scalars"]


@pytest.mark.parametrize("model_class", [AttentionNet, TransformerNet])
def test_the_projection_multihead_attention_uses_by_its_weights_is_not_called_silent(
    tmp_path: Path, model_class: type[ZooModule]
) -> None:
    # `nn.MultiheadAttention.forward` hands `out_proj.weight` to the attention function and never calls `out_proj`.
    messages = fit(model_class(), tmp_path)
    assert not [m for m in messages if "never ran" in m], messages  # before: each `out_proj`, from two callbacks


class PerSample(ZooModule):
    """DP-SGD's loop: per-sample gradients from ``torch.func`` (``vmap`` of ``grad``), clipped and written to
    ``.grad`` by hand, no backward pass; with ``outside``, the loss logged is computed by a plain forward."""

    def __init__(self, outside: bool) -> None:
        super().__init__()
        self.automatic_optimization, self.outside = False, outside
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        params = {name: p.detach() for name, p in self.net.named_parameters()}

        def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(torch.func.functional_call(self.net, params, (x[None],)), y[None])

        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
        for name, p in self.net.named_parameters():
            p.grad = grads[name].clamp(-1, 1).mean(0)
        if self.outside:
            with torch.no_grad():
                self.log("loss", F.cross_entropy(self.net(x), y))
        self.optimizers().step()


@pytest.mark.parametrize("outside", [True, False], ids=["with-outside-forward", "vmap-only"])
def test_per_sample_gradients_under_vmap_cost_no_step(tmp_path: Path, outside: bool) -> None:
    model = PerSample(outside)
    initial = copy.deepcopy(model)
    callbacks = [*every_callback(), NonFiniteGuard(), HealthMonitor(log_every_n_steps=1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Before: NonFiniteGuard's hooks raised inside vmap ("Batching rule not implemented"), the fit died.
        make_trainer(tmp_path, callbacks, max_steps=2, log_every_n_steps=1).fit(model)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "could not record" in m], messages
    assert not any(p.equal(q) for p, q in zip(model.parameters(), initial.parameters(), strict=True))
    # The gradients written by hand are read: per-sample gradients by plain autograd, one sample at a time.
    x, y = initial.x[:8], initial.y[:8]
    weight = initial.net[0].weight
    each = [torch.autograd.grad(F.cross_entropy(initial.net(x[i : i + 1]), y[i : i + 1]), weight)[0] for i in range(8)]
    expected = torch.stack(each).clamp(-1, 1).mean(0).double().norm()
    assert scalars(tmp_path, "grad_norm/net.0.weight")[0] == pytest.approx(float(expected), rel=1e-5)
    never = [m for m in messages if "never ran" in m]
    if outside:  # the plain forward is recorded, the vmapped one is not
        assert not never, never
        out = initial.net[0](initial.x[:8]).detach().double()
        assert scalars(tmp_path, "act_mean/net.0")[0] == pytest.approx(float(out.mean()), rel=1e-5)
    else:
        assert len(never) == 1, never
        assert "ran inside a `torch.func` transform" in never[0]

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from lightning_hooks import GradStats
from lightning_hooks.stats.state import derive, state
from tests.support.helpers import Probe, TinyNet, events, hook_state, make_trainer, scalars
from tests.support.zoo import ResNetish, SparseEmbeddingNet, SpectralNet


class Capture(pl.Callback):
    """Records what GradStats should report, computed independently, on every step."""

    def __init__(self) -> None:
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        self.grads[step] = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        self.before[step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after[trainer.global_step - 1] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def test_parameter_statistics_equal_an_independent_computation(tmp_path: Path) -> None:
    capture = Capture()
    make_trainer(tmp_path, [GradStats(log_every_n_steps=2), capture], max_steps=7).fit(TinyNet())
    for step in (0, 2, 4, 6):
        g = capture.grads[step]["fc1.weight"].double()
        expected = {
            "grad_norm": torch.linalg.vector_norm(g),
            "grad_mean": g.mean(),
            "grad_std": g.std(correction=0),
            "grad_abs_max": g.abs().max(),
            "grad_zero_frac": (g == 0).double().mean(),
            "grad_nonfinite": (~torch.isfinite(g)).sum(),
        }
        for tag, value in expected.items():
            assert scalars(tmp_path, f"{tag}/fc1.weight")[step] == pytest.approx(float(value), rel=1e-5, abs=1e-7), tag
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(v) for v in capture.grads[step].values()])
        )
        assert scalars(tmp_path, "grad_norm_total")[step] == pytest.approx(float(total), rel=1e-5)
        for name in capture.grads[step]:  # fc1.bias and fc2.bias, of one shape, are compared stacked
            before, after = capture.before[step][name], capture.after[step][name]
            ratio = torch.linalg.vector_norm(after - before) / torch.linalg.vector_norm(before)
            assert scalars(tmp_path, f"update_ratio/{name}")[step] == pytest.approx(float(ratio), rel=1e-4), name


def test_tags_appear_exactly_every_n_steps_and_never_for_unused_layers(tmp_path: Path) -> None:
    make_trainer(tmp_path, [GradStats(log_every_n_steps=3)], max_steps=8).fit(TinyNet())
    tags = events(tmp_path).Tags()["scalars"]
    for tag in (
        "grad_norm/fc2.bias",
        "grad_norm_total",
        "update_ratio/fc1.weight",
        "out_grad_norm/fc1",
        "out_grad_norm/act",
    ):
        assert sorted(scalars(tmp_path, tag)) == [0, 3, 6], tag
    assert not [t for t in tags if "unused" in t]


def test_output_gradients_match_plain_autograd(tmp_path: Path) -> None:
    model = TinyNet()
    reference = copy.deepcopy(model)
    make_trainer(tmp_path, [GradStats(include=["fc1", "fc2"])], max_steps=1).fit(model)
    outputs: dict[str, torch.Tensor] = {}
    for name in ("fc1", "fc2"):
        getattr(reference, name).register_forward_hook(lambda m, a, out, _n=name: outputs.__setitem__(_n, out))
    loss = F.cross_entropy(reference(reference.x[:16]), reference.y[:16])
    grads = dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values())), strict=True))
    for name, grad in grads.items():
        assert scalars(tmp_path, f"out_grad_norm/{name}")[0] == pytest.approx(
            float(torch.linalg.vector_norm(grad)), rel=1e-5
        )
        assert scalars(tmp_path, f"out_grad_abs_max/{name}")[0] == pytest.approx(float(grad.abs().max()), rel=1e-6)
        assert scalars(tmp_path, f"out_grad_nonfinite/{name}")[0] == 0


class Halves(torch.nn.Module):
    """Splits its input in two: one autograd node makes both outputs."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, dim=-1)
        return a, b


class Offset(torch.nn.Module):
    """Returns its parameter itself: an output with no autograd node behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4))

    def forward(self) -> torch.Tensor:
        return self.bias


class SplitNet(TinyNet):
    """Only the second half of ``halves``' output reaches the loss; ``offset`` returns a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 16)
        self.halves, self.offset = Halves(), Offset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, used = self.halves(self.fc1(x))
        return self.head(self.act(used)) + self.offset()[:3]


def test_output_gradients_of_a_node_with_two_outputs_and_of_a_returned_leaf(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SplitNet()
    reference = copy.deepcopy(model)
    make_trainer(tmp_path, [GradStats(include=["halves", "offset"])], max_steps=1).fit(model)
    outputs: dict[str, torch.Tensor] = {}
    reference.halves.register_forward_hook(lambda m, a, out: outputs.__setitem__("halves.out.1", out[1]))
    reference.offset.register_forward_hook(lambda m, a, out: outputs.__setitem__("offset", out))
    loss = F.cross_entropy(reference(reference.x[:16]), reference.y[:16])
    grads = dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values())), strict=True))
    for name, grad in grads.items():
        logged = scalars(tmp_path, f"out_grad_norm/{name}")[0]
        assert logged == pytest.approx(float(torch.linalg.vector_norm(grad)), rel=1e-5), name
    # the first half reaches no loss: its node runs for the second half only, with no gradient for it
    assert not [t for t in events(tmp_path).Tags()["scalars"] if t.startswith("out_grad_norm/halves.out.0")]


class Shortcut(TinyNet):
    """``fc2(h) + shortcut(h)`` with ``shortcut = nn.Identity()``, as in transformers' ResNet and many blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.shortcut = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.head(self.act(self.fc2(h) + self.shortcut(h)))


def test_the_output_gradient_of_a_pass_through_is_its_callers_alone(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Shortcut()
    reference = copy.deepcopy(model)
    make_trainer(tmp_path, [GradStats(include=["shortcut"])], max_steps=1).fit(model)
    # torch's own module backward hook: the gradient with respect to what the shortcut returned.
    seen: list[torch.Tensor] = []
    reference.shortcut.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(grad_out[0]))
    hidden: list[torch.Tensor] = []
    reference.fc1.register_forward_hook(lambda m, a, out: hidden.append(out))
    loss = F.cross_entropy(reference(reference.x[:16]), reference.y[:16])
    (whole,) = torch.autograd.grad(loss, hidden, retain_graph=True)  # what `h` gets from the block too
    loss.backward()
    expected = float(torch.linalg.vector_norm(seen[0]))
    assert scalars(tmp_path, "out_grad_norm/shortcut")[0] == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(float(torch.linalg.vector_norm(whole)), rel=0.05)  # before, that was logged


def test_inplace_relu_resnet_fits_and_reports_the_conv_output_gradient(tmp_path: Path) -> None:
    torch.manual_seed(0)
    inplace = ResNetish(inplace=True)
    plain = ResNetish(inplace=False)
    plain.load_state_dict(inplace.state_dict())
    for name, model in (("inplace", inplace), ("plain", plain)):
        make_trainer(tmp_path / name, [GradStats(types=["Conv2d"])], max_steps=2, log_every_n_steps=1).fit(model)
    for conv in ("stem.0", "layer1.0.conv1", "layer1.1.conv2"):
        a = scalars(tmp_path / "inplace", f"out_grad_norm/{conv}")
        b = scalars(tmp_path / "plain", f"out_grad_norm/{conv}")
        assert a[0] > 0
        assert a[0] == pytest.approx(b[0], rel=1e-5), conv


def test_histograms_go_to_tensorboard(tmp_path: Path) -> None:
    capture = Capture()
    make_trainer(tmp_path, [GradStats(histograms=True, output_grads=False), capture], max_steps=1).fit(TinyNet())
    histogram = events(tmp_path).Histograms("grad/fc1.weight")[0]
    assert histogram.step == 0
    assert histogram.histogram_value.num == 32
    assert histogram.histogram_value.max == pytest.approx(float(capture.grads[0]["fc1.weight"].max()))


def test_csv_logger_gets_scalars_and_one_warning_about_histograms(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [GradStats(histograms=True)], logger=False, max_steps=3, log_every_n_steps=1)
    trainer.loggers = [CSVLogger(tmp_path, name="csv")]
    with pytest.warns(UserWarning, match="logs histograms to TensorBoard, W&B and MLflow") as record:
        trainer.fit(TinyNet())
    assert sum("histograms" in str(w.message) for w in record) == 1
    header = next((tmp_path / "csv").rglob("metrics.csv")).read_text().splitlines()[0]
    assert "grad_norm/fc1.weight" in header
    assert "out_grad_norm/head" in header


def test_no_logger_warns_once_and_attaches_nothing(tmp_path: Path) -> None:
    probe = Probe("on_train_batch_start", lambda trainer, model, *args: hook_state(model))
    with pytest.warns(UserWarning, match="`GradStats` has no logger"):
        make_trainer(tmp_path, [GradStats(log_every_n_steps=1), probe], logger=False, max_steps=2).fit(TinyNet())
    assert probe.seen == [hook_state(TinyNet())] * 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"stats": ["norm", "median"]},
            ValueError,
            r"`GradStats` got `stats=\['norm', 'median'\]`; `stats` must be a non-empty list",
        ),
        ({"stats": "norm"}, TypeError, r"`GradStats` got `stats='norm'`"),
        ({"histograms": "yes"}, TypeError, r"`GradStats` got `histograms='yes'`"),
        ({"param_grads": False, "output_grads": False}, ValueError, r"enable at least one"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradStats(**kwargs)


class MixedDtypeNet(TinyNet):
    """float32 and bfloat16 parameters, and a frozen layer: the fused reductions see two groups."""

    def __init__(self) -> None:
        super().__init__()
        self.fc2.bfloat16()
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        h = self.act(self.fc2(h.bfloat16())).float()
        return self.head(self.frozen(h))


def test_mixed_dtype_statistics_equal_the_per_tensor_path(tmp_path: Path) -> None:
    capture = Capture()
    make_trainer(tmp_path, [GradStats(log_every_n_steps=1), capture], max_steps=2).fit(MixedDtypeNet())
    logged = events(tmp_path).Tags()["scalars"]
    assert {t.split("/", 1)[1] for t in logged if t.startswith("grad_norm/")} == {
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"
    }  # fmt: skip
    assert capture.grads[0]["fc2.weight"].dtype == torch.bfloat16
    for step in (0, 1):
        for name, grad in capture.grads[step].items():
            for stat, value in derive(state(grad)).items():  # the per-tensor path
                got = scalars(tmp_path, f"grad_{stat}/{name}")[step]
                assert got == pytest.approx(value, rel=1e-5, abs=1e-7), (step, name, stat)
            before, after = capture.before[step][name], capture.after[step][name]
            ratio = torch.linalg.vector_norm((after - before).double()) / torch.linalg.vector_norm(before.double())
            assert scalars(tmp_path, f"update_ratio/{name}")[step] == pytest.approx(float(ratio), rel=1e-4)


def test_a_sparse_gradient_is_read_in_its_dense_form(tmp_path: Path) -> None:
    capture = Capture()
    make_trainer(tmp_path, [GradStats(log_every_n_steps=1), capture], max_steps=2).fit(SparseEmbeddingNet())
    for step in (0, 1):
        grad = capture.grads[step]["embed.weight"]
        assert grad.is_sparse
        for stat, value in derive(state(grad.to_dense())).items():  # rows of unused tokens are zeros
            assert scalars(tmp_path, f"grad_{stat}/embed.weight")[step] == pytest.approx(value, rel=1e-5, abs=1e-7)


def test_a_complex_gradient_is_read_as_its_real_and_imaginary_parts(tmp_path: Path) -> None:
    capture = Capture()
    make_trainer(tmp_path, [GradStats(log_every_n_steps=1), capture], max_steps=2).fit(SpectralNet())
    for step in (0, 1):
        grad = capture.grads[step]["mix.weight"]
        parts = torch.stack([grad.real, grad.imag]).double()
        assert grad.is_complex()
        expected = {
            "norm": torch.linalg.vector_norm(grad.cdouble()),  # the complex norm: the parts' norm
            "mean": parts.mean(),
            "abs_max": parts.abs().max(),
        }
        for stat, value in expected.items():
            got = scalars(tmp_path, f"grad_{stat}/mix.weight")[step]
            assert got == pytest.approx(float(value), rel=1e-5, abs=1e-7), (step, stat)

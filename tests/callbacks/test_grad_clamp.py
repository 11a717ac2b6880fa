import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_hooks import GradClamp
from lightning_hooks.stats import state
from tests.support.helpers import Probe, TinyNet, make_trainer, scalars
from tests.support.zoo import SpectralNet


def _fit(tmp_path: Path, model: TinyNet, **kwargs: object) -> TinyNet:
    make_trainer(tmp_path, logger=False, max_steps=5, **kwargs).fit(model)  # type: ignore[arg-type]
    return model


def test_equals_lightning_value_clipping(tmp_path: Path) -> None:
    torch.manual_seed(0)
    start = TinyNet(lr=0.5)
    clamped = _fit(tmp_path / "a", copy.deepcopy(start), callbacks=[GradClamp(0.05)])
    clipped = _fit(
        tmp_path / "b", copy.deepcopy(start), callbacks=[], gradient_clip_val=0.05, gradient_clip_algorithm="value"
    )
    free = _fit(tmp_path / "c", copy.deepcopy(start), callbacks=[])
    for (name, a), b in zip(clamped.named_parameters(), clipped.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7), name
    # The bound was active: without it the weights end elsewhere.
    assert not all(torch.allclose(a, c) for a, c in zip(clamped.parameters(), free.parameters(), strict=True))


@pytest.mark.parametrize("chunk", [None, 10])
def test_clamped_fraction_matches_an_independent_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    if chunk is not None:  # the gradients counted in flat pieces of at most 10 values: biases together, weights alone
        monkeypatch.setattr(state, "CHUNK", chunk)
    torch.manual_seed(0)
    model = TinyNet()
    reference = copy.deepcopy(model)
    make_trainer(tmp_path, [GradClamp(0.1, log_every_n_steps=2)], max_steps=5).fit(model)
    logged = scalars(tmp_path, "grad_clamp/clamped_fraction")
    assert sorted(logged) == [0, 2, 4]
    # Step 0 sees the first batch with the initial weights.
    F.cross_entropy(reference(reference.x[:16]), reference.y[:16]).backward()
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    expected = sum(int((g.abs() > 0.1).sum()) for g in grads) / sum(g.numel() for g in grads)
    assert 0 < expected < 1
    assert logged[0] == pytest.approx(expected, rel=1e-6)


def hooked_parameters(trainer: object, model: torch.nn.Module, *args: object) -> dict[str, int]:
    return {name: len(p._backward_hooks) for name, p in model.named_parameters() if p._backward_hooks}


def gradient_peaks(trainer: object, model: torch.nn.Module, *args: object) -> dict[str, float]:
    return {name: float(p.grad.abs().max()) for name, p in model.named_parameters() if p.grad is not None}


def test_frozen_parameters_are_skipped(tmp_path: Path) -> None:
    # Accumulating: a tensor hook per parameter.
    model = TinyNet()
    model.fc1.requires_grad_(False)
    probe = Probe("on_train_batch_start", hooked_parameters)
    make_trainer(tmp_path, [GradClamp(0.1), probe], logger=False, max_steps=1, accumulate_grad_batches=2).fit(model)
    names = {"fc2.weight", "fc2.bias", "head.weight", "head.bias", "unused.weight", "unused.bias"}
    assert probe.seen == [dict.fromkeys(names, 1)] * 2
    assert not any(p._backward_hooks for p in model.parameters())


def test_one_process_clamps_as_the_backward_ends_without_a_hook_per_parameter(tmp_path: Path) -> None:
    model = TinyNet(lr=0.0)
    model.fc1.requires_grad_(False)
    hooks = Probe("on_train_batch_start", hooked_parameters)
    peaks = Probe("on_after_backward", gradient_peaks)  # the first callback hook after backward returns
    make_trainer(tmp_path, [peaks, GradClamp(0.01), hooks], logger=False, max_steps=2).fit(model)
    assert hooks.seen == [{}, {}]
    assert [sorted(seen) for seen in peaks.seen] == [["fc2.bias", "fc2.weight", "head.bias", "head.weight"]] * 2
    assert all(peak == pytest.approx(0.01) for seen in peaks.seen for peak in seen.values())


class KeepsGradients(TinyNet):
    """Never empties ``.grad``: each step's gradient is added to what it holds."""

    def optimizer_zero_grad(self, *args: object, **kwargs: object) -> None:
        pass


def test_a_gradient_already_held_is_not_clamped_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = KeepsGradients(lr=0.3, batch_size=8)
    reference = copy.deepcopy(model)
    make_trainer(tmp_path, [GradClamp(0.02)], logger=False, max_steps=3).fit(model)
    # Each backward's gradient is clamped, then added to the sum of the earlier steps' clamped gradients.
    params = [p for p in reference.parameters()]
    held = [torch.zeros_like(p) for p in params]
    for step in range(3):
        x, y = reference.x[8 * step : 8 * (step + 1)], reference.y[8 * step : 8 * (step + 1)]
        grads = torch.autograd.grad(F.cross_entropy(reference(x), y), params, allow_unused=True)
        with torch.no_grad():
            for p, h, g in zip(params, held, grads, strict=True):
                if g is not None:
                    h += g.clamp(-0.02, 0.02)
                    p -= 0.3 * h
    for (name, a), b in zip(model.named_parameters(), params, strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    # Clamping the sum instead would have bounded every held gradient by 0.02.
    assert max(float(h.abs().max()) for h in held) > 0.03


def test_tied_weight_is_hooked_once(tmp_path: Path) -> None:
    model = TinyNet()
    model.unused.weight = model.fc2.weight  # a (8, 8) weight shared by two modules
    probe = Probe("on_train_batch_start", hooked_parameters)
    make_trainer(tmp_path, [GradClamp(0.1), probe], logger=False, max_steps=1, accumulate_grad_batches=2).fit(model)
    assert probe.seen[0]["fc2.weight"] == 1
    assert not any(p._backward_hooks for p in model.parameters())


class SparseEmbedding(TinyNet):
    """TinyNet behind an embedding whose gradient is sparse."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4, sparse=True)
        self.x = torch.randint(0, 10, (self.n,), generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(100 * self.embed(x))


@pytest.mark.parametrize("mode", ["backward", "accumulated"])
def test_a_sparse_gradient_is_clamped_with_the_dense_ones(
    tmp_path: Path, mode: str, recwarn: pytest.WarningsRecorder
) -> None:
    seen = Probe(
        "on_before_optimizer_step",
        lambda trainer, pl_module, optimizer: (pl_module.embed.weight.grad, pl_module.fc1.weight.grad),
    )
    make_trainer(tmp_path, [GradClamp(0.01, mode=mode), seen], max_steps=1, logger=False).fit(SparseEmbedding())
    ((sparse, dense),) = seen.seen
    assert sparse.is_sparse
    values = sparse.coalesce().values()
    assert values.abs().max() == pytest.approx(0.01)
    assert dense.abs().max() == pytest.approx(0.01)
    assert not [w for w in recwarn if "sparse" in str(w.message).lower()]  # torch's invariant-check warning


@pytest.mark.parametrize("mode", ["backward", "accumulated"])
def test_a_model_whose_only_gradient_is_sparse_is_clamped(tmp_path: Path, mode: str) -> None:
    # Before, with no dense gradient left to clamp, the fused clamp got an empty list and the fit died at step 0
    # (a recommender's embedding tables under SparseAdam or SGD).
    model = SparseEmbedding()
    for name, p in model.named_parameters():
        p.requires_grad_(name == "embed.weight")
    seen = Probe("on_before_optimizer_step", lambda trainer, pl_module, optimizer: pl_module.embed.weight.grad)
    make_trainer(tmp_path, [GradClamp(0.01, mode=mode), seen], max_steps=2, logger=False).fit(model)
    assert [float(g.coalesce().values().abs().max()) for g in seen.seen] == pytest.approx([0.01, 0.01])


@pytest.mark.parametrize("mode", ["backward", "accumulated"])
def test_a_complex_gradient_has_its_real_and_imaginary_parts_clamped(tmp_path: Path, mode: str) -> None:
    def grad(trainer: object, pl_module: SpectralNet, optimizer: object) -> torch.Tensor:
        return pl_module.mix.weight.grad.clone()

    torch.manual_seed(0)
    model = SpectralNet()
    free, clamped = Probe("on_before_optimizer_step", grad), Probe("on_before_optimizer_step", grad)
    make_trainer(tmp_path / "free", [free], max_steps=1, logger=False).fit(copy.deepcopy(model))
    make_trainer(tmp_path / "clamped", [GradClamp(0.05, mode=mode), clamped], max_steps=1, logger=False).fit(model)
    (raw,), (got,) = free.seen, clamped.seen
    assert raw.real.abs().max() > 0.05  # the bound bites on both parts
    assert raw.imag.abs().max() > 0.05
    expected = torch.complex(raw.real.clamp(-0.05, 0.05), raw.imag.clamp(-0.05, 0.05))
    assert torch.equal(got, expected)

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_hooks import GradClamp
from tests.helpers import Probe, TinyNet, make_trainer, scalars


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


def test_clamped_fraction_matches_an_independent_count(tmp_path: Path) -> None:
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


def test_frozen_parameters_are_skipped(tmp_path: Path) -> None:
    model = TinyNet()
    model.fc1.requires_grad_(False)
    probe = Probe("on_train_batch_start", hooked_parameters)
    make_trainer(tmp_path, [GradClamp(0.1), probe], logger=False, max_steps=1).fit(model)
    names = {"fc2.weight", "fc2.bias", "head.weight", "head.bias", "unused.weight", "unused.bias"}
    assert probe.seen == [dict.fromkeys(names, 1)]
    assert not any(p._backward_hooks for p in model.parameters())


def test_tied_weight_is_hooked_once(tmp_path: Path) -> None:
    model = TinyNet()
    model.unused.weight = model.fc2.weight  # a (8, 8) weight shared by two modules
    probe = Probe("on_train_batch_start", hooked_parameters)
    make_trainer(tmp_path, [GradClamp(0.1), probe], logger=False, max_steps=1).fit(model)
    assert probe.seen[0]["fc2.weight"] == 1
    assert not any(p._backward_hooks for p in model.parameters())

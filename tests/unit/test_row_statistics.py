"""Statistics of activations and output gradients reduced in rows, through a real fit, against the per-tensor path."""

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hooks import ActivationStats, GradStats
from lightning_hooks.stats import batch as _stats
from lightning_hooks.stats.state import combine, derive, state
from tests.support.helpers import TinyNet, make_trainer, scalars

LOGGED = {"act": ("mean", "std", "abs_max", "zero_frac", "nonfinite"), "out_grad": ("norm", "abs_max", "nonfinite")}


class RowNet(TinyNet):
    """Outputs of one shape from several modules: an in-place ReLU after ``fc1`` and ``fc2``, called twice; ``fc2``
    in bfloat16; ``side`` with a NaN weight, its NaNs kept out of the loss (and so out of every gradient)."""

    def __init__(self) -> None:
        super().__init__(batch_size=8)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.side = nn.Linear(8, 8)
        self.fc2.bfloat16()
        with torch.no_grad():
            self.side.weight[0, 0] = float("nan")
        self.seen: dict[tuple[str, str, int], list[torch.Tensor]] = {}
        for name in ("fc1", "fc2", "act", "side"):
            getattr(self, name).register_forward_hook(self._capture(name))

    def _capture(self, name: str) -> Any:
        """What the per-tensor path is given: each call's output and its gradient, copied when the hook runs."""

        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if not self.training or not torch.is_grad_enabled():
                return
            step = self.global_step
            self.seen.setdefault(("act", name, step), []).append(out.detach().clone())
            if out.requires_grad:
                out.register_hook(lambda g: self.seen.setdefault(("out_grad", name, step), []).append(g.clone()))

        return hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        h = self.act(self.fc2(h.bfloat16())).float()
        side = self.side(h)
        return self.head(h + torch.where(side.isfinite(), side, 0.0))


@pytest.mark.parametrize(("row_max", "slab_bytes"), [(1 << 15, 1 << 20), (1 << 15, 3 * 256), (10, 1 << 20)])
def test_logged_statistics_equal_the_per_tensor_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row_max: int, slab_bytes: int
) -> None:
    # slab_bytes=768: slabs of three [8, 8] float32 rows, full and reduced in the middle of forward and backward, with
    # a call of two micro-batches spread over two slabs; row_max=10: each output is reduced in its hook
    monkeypatch.setattr(_stats, "ROW_MAX", row_max)
    monkeypatch.setattr(_stats, "SLAB_BYTES", slab_bytes)
    model = RowNet()
    callbacks = [ActivationStats(log_every_n_steps=1), GradStats(log_every_n_steps=1, param_grads=False)]
    make_trainer(tmp_path, callbacks, max_steps=2, log_every_n_steps=1, accumulate_grad_batches=2).fit(model)
    assert len(model.seen["act", "act", 0]) == 4  # two calls in each of two micro-batches
    assert model.seen["act", "fc2", 0][0].dtype == torch.bfloat16
    for (group, name, step), tensors in model.seen.items():
        expected = derive(combine(state(t) for t in tensors))  # pooled per tensor on the host
        for stat in LOGGED[group]:
            logged = scalars(tmp_path, f"{group}_{stat}/{name}")
            assert logged[step] == pytest.approx(expected[stat], rel=1e-5, abs=1e-6, nan_ok=True), (group, name, stat)
    assert scalars(tmp_path, "act_nonfinite/side")[0] == 16  # column 0 of both micro-batches' 8 rows
    assert scalars(tmp_path, "act_nonfinite/fc1")[0] == 0
    assert scalars(tmp_path, "out_grad_nonfinite/side")[0] == 0
    assert scalars(tmp_path, "act_zero_frac/act")[0] > 0.2  # after the ReLU; fc1's own outputs were not clamped
    assert scalars(tmp_path, "act_zero_frac/fc1")[0] == 0


def test_a_module_output_changed_in_place_after_its_hook_is_logged_as_it_was(tmp_path: Path) -> None:
    model = RowNet()
    make_trainer(tmp_path, [ActivationStats(log_every_n_steps=1, include=["fc1"])], max_steps=1).fit(model)
    first = model.seen["act", "fc1", 0][0]
    assert (first < 0).any()  # what the in-place ReLU then clamped
    assert scalars(tmp_path, "act_mean/fc1")[0] == pytest.approx(float(first.double().mean()), rel=1e-5)
    assert F.relu(first).mean() > first.mean()

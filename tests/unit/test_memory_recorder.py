"""The memory recorder on a bare ``nn.Module``, without a Trainer (pure torch)."""

from __future__ import annotations

import gc

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_hooks.recorders.memory import record_step


def test_record_step_on_a_bare_module_with_a_frozen_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model[0].requires_grad_(False)  # a frozen first layer: torch's own tracker refuses it
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    with record_step(model, list(model.named_modules()), [optimizer], x) as recorder:
        model(x).square().mean().backward()
        optimizer.step()
    memory = recorder.result([optimizer])
    assert _get_current_dispatch_mode() is None
    assert gc.isenabled()
    rows = {row.name: row for row in memory.rows}
    assert rows[""].parameters == sum(p.nelement() * 4 for p in model.parameters())
    assert rows["0"].gradients == 0  # frozen
    assert rows["2"].gradients == rows["2"].parameters == (32 * 4 + 4) * 4
    # Adam's two moments, and a float32 step count for each of the two parameters.
    assert rows["2"].optimizer_state == 2 * rows["2"].parameters + 2 * 4
    # Nothing before the second Linear needs a gradient, so Tanh keeps nothing; that Linear keeps its input (8 x 32).
    assert (rows["0"].activations, rows["1"].activations, rows["2"].activations) == (0, 0, 8 * 32 * 4)
    assert memory.peak > 0

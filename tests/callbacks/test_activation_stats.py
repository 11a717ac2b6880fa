import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStats, GradStats
from tests.support.helpers import TinyNet, events, make_trainer, scalars
from tests.support.zoo import LSTMNet, ResNetish


def outputs_of(model: TinyNet, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Every call's output per module, from a plain forward of a copy."""
    found: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, a, out, _n=name or "root": found.setdefault(_n, []).append(out.detach()))
    model(x)
    return found


def test_statistics_equal_an_independent_computation(tmp_path: Path) -> None:
    model = TinyNet()
    expected = outputs_of(copy.deepcopy(model), model.x[:16])
    make_trainer(tmp_path, [ActivationStats(log_every_n_steps=2)], max_steps=5).fit(model)
    for layer in ("fc1", "act", "head", "root"):
        t = torch.cat([o.flatten() for o in expected[layer]]).double()  # `act` runs twice: pooled
        reference = {
            "act_mean": t.mean(),
            "act_std": t.std(correction=0),
            "act_abs_max": t.abs().max(),
            "act_zero_frac": (t == 0).double().mean(),
            "act_nonfinite": (~torch.isfinite(t)).sum(),
        }
        for tag, value in reference.items():
            assert scalars(tmp_path, f"{tag}/{layer}")[0] == pytest.approx(float(value), rel=1e-5, abs=1e-7), tag
    assert sorted(scalars(tmp_path, "act_mean/fc1")) == [0, 2, 4]


def test_validation_and_sanity_check_are_not_counted(tmp_path: Path) -> None:
    class LoudValidation(TinyNet):
        validated = 0

        def val_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(self.x[:5] * 1000, self.y[:5]), batch_size=5)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.validated += 1
            super().validation_step(batch, batch_idx)

    model = LoudValidation()
    trainer = make_trainer(
        tmp_path,
        [ActivationStats(log_every_n_steps=1)],
        max_steps=4,
        num_sanity_val_steps=1,
        limit_val_batches=1,
        val_check_interval=1,
    )
    trainer.fit(model)
    assert model.validated >= 4  # sanity check and validation after every step did run
    logged = scalars(tmp_path, "act_abs_max/fc1")
    assert sorted(logged) == [0, 1, 2, 3]
    assert max(logged.values()) < 100  # training inputs are O(1); validation inputs are 1000x larger


def test_nan_in_one_layer_is_counted_there_and_not_before(tmp_path: Path) -> None:
    model = TinyNet()
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("nan")
    make_trainer(tmp_path, [ActivationStats()], max_steps=1).fit(model)
    assert scalars(tmp_path, "act_nonfinite/fc1")[0] == 0
    assert scalars(tmp_path, "act_nonfinite/fc2")[0] == 16  # one NaN weight poisons output column 0
    assert scalars(tmp_path, "act_nonfinite/head")[0] == 48


def test_nested_outputs_are_named_by_path(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ActivationStats(include=["lstm"], stats=["mean"])], max_steps=1).fit(LSTMNet())
    tags = set(events(tmp_path).Tags()["scalars"])
    assert {"act_mean/lstm.out.0", "act_mean/lstm.out.1.0", "act_mean/lstm.out.1.1"} <= tags
    assert not [t for t in tags if t.startswith("act_std")]


class EmptyTail(torch.nn.Module):
    """Returns its input and an empty slice of it."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x[:, :0]


class WithEmptyOutput(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.tail = EmptyTail()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept, _ = self.tail(self.fc1(x))
        return self.head(self.act(self.fc2(self.act(kept))))


def test_an_empty_output_gets_no_statistics_and_the_others_theirs(tmp_path: Path) -> None:
    model = WithEmptyOutput()
    expected = outputs_of(copy.deepcopy(model).fc1, model.x[:16])["root"][0].double()
    make_trainer(tmp_path, [ActivationStats(log_every_n_steps=2)], max_steps=3).fit(model)
    tags = events(tmp_path).Tags()["scalars"]
    assert "act_mean/tail.out.0" in tags
    assert not [t for t in tags if t.endswith("tail.out.1")]
    assert scalars(tmp_path, "act_std/tail.out.0")[0] == pytest.approx(float(expected.std(correction=0)), rel=1e-5)
    assert sorted(scalars(tmp_path, "act_abs_max/head")) == [0, 2]


def test_histograms(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ActivationStats(histograms=True, include=["fc1"])], max_steps=1).fit(TinyNet())
    histogram = events(tmp_path).Histograms("act/fc1")[0].histogram_value
    assert histogram.num == 16 * 8
    assert sum(histogram.bucket) == 16 * 8


def test_both_callbacks_on_an_inplace_relu_resnet(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ActivationStats(), GradStats()], max_steps=3, log_every_n_steps=1).fit(ResNetish())
    tags = set(events(tmp_path).Tags()["scalars"])
    for tag in (
        "act_zero_frac/layer1.0.relu",
        "act_mean/layer1.1.conv2",
        "out_grad_norm/layer1.0.bn2",
        "grad_norm/fc.weight",
    ):
        assert tag in tags
    # The ReLU's zero fraction is high, the convolution's is not.
    assert scalars(tmp_path, "act_zero_frac/stem.2")[0] > 0.2
    assert scalars(tmp_path, "act_zero_frac/stem.0")[0] == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"stats": ["norm"]},
            ValueError,
            r"`ActivationStats` got `stats=\['norm'\]`; `stats` must be a non-empty list",
        ),
        ({"stats": []}, ValueError, r"`ActivationStats` got `stats=\[\]`"),
        ({"log_every_n_steps": 0}, ValueError, r"`ActivationStats` got `log_every_n_steps=0`"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ActivationStats(**kwargs)

"""Constructors refuse bad arguments at once, naming the callback, the argument, the value and the fix."""

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_hooks import GradClamp, GradStats, ShapeLogger
from tests.helpers import TinyNet, hook_state, make_trainer


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, r"`GradClamp` got `value=0`; `value` must be a positive finite number"),
        (-1, ValueError, r"`GradClamp` got `value=-1`; `value` must be a positive finite number"),
        (float("nan"), ValueError, r"`GradClamp` got `value=nan`"),
        (float("inf"), ValueError, r"`GradClamp` got `value=inf`"),
        ("0.2", TypeError, r"`GradClamp` got `value='0.2'`; `value` must be a positive finite number"),
        (True, TypeError, r"`GradClamp` got `value=True`"),
        (None, TypeError, r"`GradClamp` got `value=None`"),
    ],
)
def test_grad_clamp_value(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradClamp(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [ShapeLogger, lambda **kw: GradClamp(0.2, **kw)])
@pytest.mark.parametrize("every", [0, -5, 2.5, True])
def test_log_every_n_steps_must_be_positive(cls: type, every: object) -> None:
    with pytest.raises(
        ValueError, match=rf"got `log_every_n_steps={every!r}`; `log_every_n_steps` must be a positive integer"
    ):
        cls(log_every_n_steps=every)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"types": ["Conv2D"]},
            ValueError,
            r"`ShapeLogger` got `types=\['Conv2D'\]`; 'Conv2D' is not the name of any .*'Conv2d'",
        ),
        ({"types": "Linear"}, TypeError, r"`ShapeLogger` got `types='Linear'`; `types` must be a list of strings"),
        ({"include": [3]}, TypeError, r"`ShapeLogger` got `include=\[3\]`"),
        ({"max_depth": -1}, ValueError, r"`ShapeLogger` got `max_depth=-1`; `max_depth` must be an integer >= 0"),
        (
            {"collapse_repeats": "yes"},
            TypeError,
            r"`ShapeLogger` got `collapse_repeats='yes'`; `collapse_repeats` must be True or False",
        ),
    ],
)
def test_selection_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ShapeLogger(**kwargs)


def test_grad_clamp_mode() -> None:
    with pytest.raises(ValueError, match=r"`GradClamp` got `mode='sum'`; `mode` must be 'backward' or 'accumulated'"):
        GradClamp(0.2, mode="sum")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("callback", "match"),
    [
        (
            GradClamp(0.2),
            r"`GradClamp\(mode='backward'\)` does not support .*ModelParallelStrategy.*use `mode='accumulated'`",
        ),
        (
            GradStats(),
            r"`GradStats\(param_grads=True\)` does not support .*ModelParallelStrategy.*set `param_grads=False`",
        ),
    ],
    ids=["GradClamp", "GradStats"],
)
def test_sharded_strategies_are_refused_at_setup_with_the_fix(tmp_path: Path, callback: Callback, match: str) -> None:
    trainer = make_trainer(tmp_path, [callback], strategy=ModelParallelStrategy(), logger=False, max_steps=1)
    model = TinyNet()
    environment = dict(os.environ)
    try:
        with pytest.raises(MisconfigurationException, match=match):
            trainer.fit(model)
    finally:  # Lightning leaves its one-process group and its rendezvous port behind; later tests must not see them
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    assert hook_state(model) == hook_state(TinyNet())

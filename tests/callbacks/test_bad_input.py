"""Constructors refuse bad arguments at once, naming the callback, the argument, the value and the fix."""

import pytest

from lightning_hooks import GradClamp, ShapeLogger


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

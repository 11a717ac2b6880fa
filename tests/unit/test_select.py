import re

import pytest
import torch
from torch import nn

from lightning_hooks.core.select import ModuleSelector, depth, label, trainable_parameters


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.norm = nn.BatchNorm2d(2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = Block()
        self.body = nn.Sequential(Block(), Block())
        self.head = nn.Linear(2, 2)


def names(**kwargs: object) -> list[str]:
    return [name for name, _ in ModuleSelector(**kwargs).select(Net())]  # type: ignore[arg-type]


def test_default_selects_every_module_in_registration_order() -> None:
    assert names() == [name for name, _ in Net().named_modules()]
    assert names()[0] == ""


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"include": [""]}, [""]),
        ({"include": ["body.*.conv"]}, ["body.0.conv", "body.1.conv"]),
        ({"include": ["stem*"], "exclude": ["*.norm"]}, ["stem", "stem.conv"]),
        ({"types": ["Linear"]}, ["head"]),
        ({"types": ["_ConvNd"]}, ["stem.conv", "body.0.conv", "body.1.conv"]),  # matched along the MRO
        ({"types": ["_BatchNorm"], "max_depth": 2}, ["stem.norm"]),
        ({"max_depth": 1}, ["", "stem", "body", "head"]),
        ({"max_depth": 0}, [""]),
    ],
)
def test_selection(kwargs: dict, expected: list[str]) -> None:
    assert names(**kwargs) == expected


def test_include_matching_nothing_lists_valid_names() -> None:
    selector = ModuleSelector(include=["stem.cnv"], owner="ShapeLogger")
    with pytest.raises(
        ValueError, match=r"`ShapeLogger` got `include=\['stem.cnv'\]`; 'stem.cnv' matches no module.*'stem.conv'"
    ):
        selector.select(Net())


def test_a_pattern_is_shown_as_written_and_names_in_model_order() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(6)))
    with pytest.raises(ValueError, match="matches no module") as error:
        ModuleSelector(include=["encoder.*"], owner="GradStats").select(model)
    message = str(error.value)
    assert message.startswith("`GradStats` got `include=['encoder.*']`; 'encoder.*' matches no module of Sequential.")
    assert "'', '0', '1', '2', '3', '4', '5'" in message


def test_type_absent_from_model_lists_the_models_own_classes_first() -> None:
    selector = ModuleSelector(types=["LSTM"], owner="GradClamp")
    own = "'Net', 'Block', 'Conv2d', 'BatchNorm2d', 'Sequential', 'Linear', 'Module'"  # then the base classes
    with pytest.raises(
        ValueError, match=re.escape(f"has no module of type 'LSTM'. Types in this model include: {own}")
    ):
        selector.select(Net())


def test_unknown_type_name_fails_at_construction() -> None:
    with pytest.raises(ValueError, match=r"`GradClamp` got `types=\['Conv2D'\]`.*'Conv2d'"):
        ModuleSelector(types=["Conv2D"], owner="GradClamp")


def test_bare_string_pattern_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"`include` must be a list of strings.*include=\['head'\]"):
        ModuleSelector(include="head")  # type: ignore[arg-type]


def test_compiled_submodule_keeps_its_clean_name() -> None:
    net = Net()
    net.head = torch.compile(net.head)  # type: ignore[assignment]
    selected = ModuleSelector(types=["Linear"]).select(net)
    assert [(name, type(m).__name__) for name, m in selected] == [("head", "Linear")]


def test_depth_and_label() -> None:
    assert [depth(n) for n in ("", "a", "a.b")] == [0, 1, 2]
    assert label("") == "root"
    assert label("a.b") == "a.b"


def test_torchmetrics_metrics_are_not_selected() -> None:
    from torchmetrics.classification import MulticlassAccuracy

    net = Net()
    net.acc = MulticlassAccuracy(num_classes=3)
    assert "acc" not in [name for name, _ in ModuleSelector().select(net)]


def test_activation_checkpointing_wrappers_are_looked_through() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = Net()
    net.head = checkpoint_wrapper(net.head)  # type: ignore[assignment]
    names = [name for name, _ in ModuleSelector(types=["Linear"]).select(net)]
    assert "head" in names
    assert not any("_checkpoint_wrapped_module" in name for name in names)
    params = [name for name, _ in trainable_parameters(ModuleSelector().select(net))]
    assert "head.weight" in params

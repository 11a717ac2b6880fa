"""The pure-torch core of NonFiniteGuard: readings, and where NaN/Inf first appear."""

import math
import pickle

import pytest
import torch
from torch import nn

from lightning_hooks.core.handles import HookHandles
from lightning_hooks.core.select import ModuleSelector
from lightning_hooks.diagnose.finding import INF, NAN, Reading
from lightning_hooks.recorders.finite import (
    NonFiniteRecorder,
    Readings,
    find_nonfinite,
    finite_step,
    grad_readings,
    parameter_readings,
)
from lightning_hooks.stats import state

NaN, Inf = math.nan, math.inf


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class NaNGrad(torch.autograd.Function):
    """Identity forward; backward puts a NaN into the first gradient value."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = NaN
        return grad


class BadBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NaNGrad.apply(x)


@pytest.mark.parametrize(
    ("values", "dtype", "expected"),
    [
        ([1.0, -2.0, 3.0], torch.float32, Reading(-2.0, 3.0, 3, 0)),
        ([1.0, NaN, 3.0, -Inf], torch.float32, Reading(NaN, NaN, 4, 2)),
        ([1.0, Inf, -2.0], torch.float16, Reading(-2.0, Inf, 3, 1)),
        ([0.5, -Inf], torch.bfloat16, Reading(-Inf, 0.5, 2, 1)),
        ([1.0, 2.0], torch.float64, Reading(1.0, 2.0, 2, 0)),
    ],
    ids=["finite", "nan", "half-inf", "bf16-neg-inf", "double"],
)
def test_readings_give_range_size_and_nonfinite_count(
    values: list[float], dtype: torch.dtype, expected: Reading
) -> None:
    readings = Readings()
    slot = readings.take(torch.tensor(values, dtype=dtype))
    got, extra = readings.read([torch.tensor(7.0)])
    assert slot is not None
    assert repr(got[slot]) == repr(expected)  # repr: NaN == NaN
    assert extra == [7.0]


@pytest.mark.parametrize(
    "tensor", [torch.arange(3), torch.zeros(0), torch.tensor([True])], ids=["int", "empty", "bool"]
)
def test_tensors_without_values_to_check_are_not_read(tensor: torch.Tensor) -> None:
    assert Readings().take(tensor) is None


@pytest.mark.parametrize(("low", "high", "severity"), [(-1.0, 2.0, 0), (-Inf, 2.0, INF), (1.0, NaN, NAN)])
def test_severity_from_the_range(low: float, high: float, severity: int) -> None:
    assert Reading(low, high, 2).severity == severity


def test_the_leaf_that_made_a_nan_is_named_not_the_containers_that_pass_it_on() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Tanh(), Log()), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    finding = find_nonfinite(model, x)
    assert finding is not None
    assert (finding.phase, finding.module, finding.module_type, finding.made_here) == ("forward", "1.1", "Log", True)
    path, reading = finding.tensor  # type: ignore[misc]
    with torch.no_grad():
        tanh = torch.tanh(model[0](x))
    assert path == ""
    assert reading.nonfinite == int((tanh < 0).sum())
    assert reading.numel == tanh.numel()
    ((_, given),) = finding.given
    assert given.min == pytest.approx(float(tanh.min()))
    assert given.max == pytest.approx(float(tanh.max()))


def test_a_nested_output_is_named_by_its_path() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"kept": x, "logs": (x * 2, torch.log(x))}

    finding = find_nonfinite(nn.Sequential(nn.Identity(), Split()), torch.tensor([[-1.0, 2.0]]))
    assert finding is not None
    assert finding.module == "1"
    assert finding.tensor[0] == "logs.1"  # type: ignore[index]
    assert "output `logs.1`: 1 of 2 values are NaN" in str(finding)


def test_code_of_a_container_between_its_children_names_the_container() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.log(self.fc1(x) - 100))

    finding = find_nonfinite(Outer(), torch.zeros(1, 2))
    assert finding is not None
    assert (finding.module, finding.layer, finding.made_here) == ("", "root", True)
    assert "`root` (Outer) made non-finite values from finite inputs" in str(finding)


def test_nan_in_the_batch_is_where_values_came_in_not_a_maker() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    finding = find_nonfinite(model, torch.tensor([[NaN, 1.0]]))
    assert finding is not None
    assert (finding.module, finding.made_here) == ("0", False)
    assert "no selected module made non-finite values from finite ones" in str(finding)
    assert "inputs (already non-finite): input min nan, max nan" in str(finding)


def test_a_fully_masked_attention_row_is_named_although_the_mask_holds_inf() -> None:
    class MaskedSoftmax(nn.Module):
        def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.softmax(scores + mask, dim=-1)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk, self.softmax = nn.Linear(4, 4), MaskedSoftmax()

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            q = self.qk(x)
            return self.softmax(q @ q.transpose(-1, -2), mask=mask) @ x

    mask = torch.zeros(3, 3)
    mask[0, 1:] = -Inf
    assert find_nonfinite(Attention(), torch.randn(2, 3, 4), mask) is None  # -inf in an input is no finding
    mask[1] = -Inf  # a row with nothing to attend to: softmax gives NaN
    finding = find_nonfinite(Attention(), torch.randn(2, 3, 4), mask)
    assert finding is not None
    assert (finding.module, finding.module_type, finding.made_here) == ("softmax", "MaskedSoftmax", True)
    assert "input `mask` min -inf, max 0" in str(finding)


def test_a_nan_gradient_is_named_in_backward_even_before_an_inplace_relu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), BadBackward(), nn.ReLU(inplace=True), nn.Linear(8, 2))
    finding = find_nonfinite(model, torch.randn(5, 4), loss_fn=lambda out: out.sum())
    assert finding is not None
    assert (finding.phase, finding.module, finding.module_type, finding.made_here) == (
        "backward",
        "1",
        "BadBackward",
        True,
    )
    assert finding.tensor[1].nonfinite == 1  # type: ignore[index]
    assert [path for path, _ in finding.given] == [""]
    assert math.isfinite(finding.given[0][1].max)
    assert finding.shared_with == ()


def test_modules_sharing_an_input_are_all_named_in_backward() -> None:
    class Fork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1), nn.Sequential(BadBackward(), nn.Linear(2, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            return self.a(h) + self.b(h)

    finding = find_nonfinite(Fork(), torch.ones(3, 2), loss_fn=lambda out: out.sum())
    assert finding is not None
    # `b` and `b.0` share the input too: the innermost of them stands for both.
    assert {finding.module, *finding.shared_with} == {"a", "b.0"}
    assert "its gradient is the sum of theirs" in str(finding)


def test_a_loss_made_after_the_model_and_a_gradient_made_after_it() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    x = torch.ones(4, 2)
    finding = find_nonfinite(model, x, loss_fn=lambda out: torch.log(-out.abs() - 1).sum())
    assert finding is not None
    assert finding.phase == "loss"
    # A finite loss whose gradient is not: sqrt at 0.
    finding = find_nonfinite(model, x, loss_fn=lambda out: (out - out.detach()).abs().sqrt().sum())
    assert finding is not None
    assert (finding.phase, finding.module, finding.made_here) == ("backward", "1", False)
    assert "was already non-finite when it arrived" in str(finding)


def test_a_healthy_model_and_an_activation_checkpoint_report_nothing() -> None:
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False)

    assert find_nonfinite(Checkpointed(), torch.randn(2, 3, requires_grad=True), loss_fn=torch.sum) is None


def test_parameter_gradients_are_read_in_one_call_and_counted_only_when_bad() -> None:
    grads = [
        ("w", torch.tensor([1.0, NaN, Inf])),
        ("b", torch.tensor([3.0, -4.0])),
        ("big", torch.tensor([3e38, 3e38])),  # finite, but the squares of its norm overflow
    ]
    norms = torch.stack(grad_readings(grads)).tolist()
    assert math.isnan(norms[0])
    assert norms[1] == 5.0
    assert norms[2] == Inf
    ((name, reading),) = parameter_readings(grads, norms)
    assert (name, reading.nonfinite, reading.numel) == ("w", 2, 3)


def test_the_recorder_pickles_mid_step_without_what_it_recorded() -> None:
    recorder = NonFiniteRecorder()
    recorder.active = True
    model = nn.Linear(2, 2)
    with HookHandles() as handles:
        recorder.attach(ModuleSelector().select(model), handles)
        model(torch.ones(1, 2))
        assert len(recorder) == 2
        copy = pickle.loads(pickle.dumps(model))
    hook = next(iter(copy._forward_hooks.values()))
    assert len(hook.recorder) == 0
    assert not hook.recorder.active


@pytest.mark.parametrize("bad", [NaN, Inf, -Inf])
@pytest.mark.parametrize("where", range(5))
def test_finite_step_finds_one_bad_value_wherever_it_is(
    monkeypatch: pytest.MonkeyPatch, bad: float, where: int
) -> None:
    # On the CPU the step's tensors are summed end to end in chunks: with chunks of at most 4 values here, the
    # five tensors (float32, bfloat16, float64, a 0-d loss) fall into several, and a bad value is found in each.
    monkeypatch.setattr(state, "CHUNK", 4)
    tensors = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.float64), torch.ones(5)]
    loss = torch.tensor(2.0)
    assert finite_step(tensors, [loss])
    target = [*tensors, loss][where]
    target.view(-1)[-1] = bad
    assert not finite_step(tensors, [loss])


def test_finite_step_does_not_overflow_half_precision_sums() -> None:
    # Finite float16 gradients whose sum is beyond float16's range (65,504) are still a finite step.
    grads = [torch.full((100,), 60_000.0, dtype=torch.float16) for _ in range(3)]
    assert finite_step(grads, [torch.tensor(1.0, dtype=torch.float16)])
    assert not finite_step([*grads, torch.tensor([float("inf")], dtype=torch.float16)])


def test_finite_step_reads_both_parts_of_complex_gradients() -> None:
    grads = [torch.ones(3), torch.ones(2, dtype=torch.complex64)]
    assert finite_step(grads)
    grads[1][0] = complex(1.0, float("nan"))
    assert not finite_step(grads)

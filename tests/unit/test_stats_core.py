"""The statistics core on plain tensors: states, pooling, histograms and the one host transfer."""

import math
import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hooks.core.handles import HookHandles
from lightning_hooks.recorders.activations import ActivationRecorder
from lightning_hooks.recorders.gradients import ParamGradRecorder
from lightning_hooks.stats import batch as _stats
from lightning_hooks.stats.batch import Across, StatBatch
from lightning_hooks.stats.histogram import HIST_SAMPLE, Histogram, histogram_rows
from lightning_hooks.stats.state import CHUNK, State, combine, derive, norm_total, pool, state, state_row


def states(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The per-tensor states of ``tensors``, a row each."""
    return torch.stack([state_row(t) for t in tensors])


def histogram(values: torch.Tensor, bins: int) -> torch.Tensor:
    return histogram_rows(values.reshape(1, -1), bins)[0]


def reference(t: torch.Tensor) -> dict[str, float]:
    x = t.detach().double()
    return {
        "norm": float(torch.linalg.vector_norm(x)),
        "mean": float(x.mean()),
        "std": float(x.std(correction=0)),
        "abs_max": float(x.abs().max()),
        "zero_frac": float((x == 0).double().mean()),
        "nonfinite": float((~torch.isfinite(x)).sum()),
    }


def seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "tensor",
    [
        seeded(1000, seed=0) * 5 + 3,
        torch.relu(seeded(64, 32, seed=1)),
        torch.full((7,), 2.5),
        torch.tensor([1.0]),
        seeded(3, 4, seed=2).half(),
        torch.arange(10),
    ],
    ids=["shifted", "relu", "constant", "single", "half", "int"],
)
def test_a_state_gives_the_reference_statistics(tensor: torch.Tensor) -> None:
    got = derive(state(tensor))
    for name, value in reference(tensor).items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_nonfinite_values_are_counted() -> None:
    got = derive(state(torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0])))
    assert got["nonfinite"] == 3
    assert got["zero_frac"] == pytest.approx(0.2)
    assert math.isnan(got["mean"])


def test_pooled_states_equal_the_concatenation() -> None:
    parts = [seeded(n, seed=3 + i) * (i + 1) + i for i, n in enumerate((10, 300, 1))]
    table = states(parts)
    pooled = State._make(pool(table, torch.tensor([0, 0, 0]), 1)[0].tolist())
    got = derive(pooled)
    for name, value in reference(torch.cat(parts)).items():
        assert got[name] == pytest.approx(value, rel=1e-5), name
    assert derive(combine([state(p) for p in parts])) == pytest.approx(got, rel=1e-12)


def test_pooling_keeps_keys_apart() -> None:
    a, b = seeded(50, seed=7), seeded(20, seed=8) * 3
    table = states([a[:30], b, a[30:]])
    pooled = pool(table, torch.tensor([0, 1, 0]), 2)
    assert derive(State._make(pooled[0].tolist())) == pytest.approx(reference(a), rel=1e-5)
    assert derive(State._make(pooled[1].tolist())) == pytest.approx(reference(b), rel=1e-5)


def test_a_nan_peak_wins_the_max_in_any_order() -> None:
    table = states([torch.tensor([1.0, float("nan")]), torch.tensor([5.0])])
    for order in ([0, 1], [1, 0]):
        pooled = pool(table[order], torch.tensor([0, 0]), 1)
        assert math.isnan(State._make(pooled[0].tolist()).abs_max)
    finite = states([torch.tensor([1.0, -7.0]), torch.tensor([5.0])])
    assert State._make(pool(finite, torch.tensor([0, 0]), 1)[0].tolist()).abs_max == 7.0


def test_empty_tensor_gives_no_statistics() -> None:
    assert derive(state(torch.zeros(0))) == {}


def test_norm_total_is_the_norm_of_all_tensors_together() -> None:
    parts = [seeded(9, seed=9), seeded(4, 4, seed=10)]
    expected = float(torch.linalg.vector_norm(torch.cat([p.flatten() for p in parts]).double()))
    assert norm_total(state(p) for p in parts) == pytest.approx(expected, rel=1e-6)


def test_a_tiny_spread_around_a_large_mean_keeps_its_precision() -> None:
    t = 1000 + 1e-3 * seeded(4096, seed=5)
    assert derive(state(t))["std"] == pytest.approx(reference(t)["std"], rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nonfinite", [[], [math.nan, math.inf]], ids=["finite", "nan-inf"])
def test_histogram_matches_histc_in_the_values_dtype_and_skips_nonfinite(
    dtype: torch.dtype, nonfinite: list[float]
) -> None:
    t = seeded(5000, seed=4).to(dtype)
    given = torch.cat([t, torch.tensor(nonfinite, dtype=dtype)])
    row = histogram(given, 20).tolist()
    lo, hi, num, total, squares = row[:5]
    assert (lo, hi) == (float(t.min()), float(t.max()))
    assert num == 5000
    assert total == pytest.approx(float(t.double().sum()), rel=1e-5)
    assert squares == pytest.approx(float(t.double().square().sum()), rel=1e-5)
    assert row[5:] == torch.histc(t, bins=20, min=lo, max=hi).tolist()
    assert torch.equal(given[:5000], t)  # the caller's values are left alone


@pytest.mark.parametrize(
    "row", [[math.inf, math.inf], [-math.inf, math.nan], [math.nan, math.nan]], ids=["inf", "-inf-nan", "nan"]
)
def test_a_histogram_with_no_finite_value_counts_nothing(row: list[float]) -> None:
    got = histogram_rows(torch.tensor([row, [2.5, 2.5]]), 4).tolist()
    assert got[0] == [math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # as from no values at all
    assert got[1] == [2.5, 2.5, 2.0, 5.0, 12.5, 2.0, 0.0, 0.0, 0.0]  # a constant row: all in the first bucket


def fetch_histogram(calls: list[torch.Tensor], bins: int) -> tuple[list[float], list[float], float]:
    batch = StatBatch(bins)
    batch.start()
    for values in calls:
        batch.add(("act", "layer"), values, histogram=True)
    hist = batch.fetch().histograms[("act", "layer")]
    return hist.bucket_limits, hist.bucket_counts, hist.num


def test_a_histogram_of_several_calls_counts_every_call_in_the_right_bucket() -> None:
    # The reproduction of the bug: 1,000 values in [0, 1] then 3,000 in [10, 11].
    first = torch.rand(1000, generator=torch.Generator().manual_seed(11))
    second = 10 + torch.rand(3000, generator=torch.Generator().manual_seed(12))
    limits, counts, num = fetch_histogram([first, second], 4)
    everything = torch.cat([first, second]).double()
    assert num == 4000
    assert sum(counts) == 4000
    assert limits[-1] == pytest.approx(float(everything.max()))
    expected = torch.histc(everything, bins=4, min=float(everything.min()), max=float(everything.max()))
    assert counts == expected.tolist()
    assert counts[0] == 1000
    assert counts[-1] == 3000


def test_histograms_sample_each_call_of_a_large_tensor() -> None:
    _, counts, num = fetch_histogram([torch.ones(HIST_SAMPLE * 3 + 1), torch.zeros(10)], 8)
    assert num <= HIST_SAMPLE + 10
    assert counts[0] == 10


def test_a_histogram_sample_is_a_copy_that_later_in_place_ops_do_not_change() -> None:
    batch = StatBatch(4)
    batch.start()
    x = torch.arange(8.0)
    batch.add(("act", "x"), x, histogram=True)
    x.mul_(100)
    hist = batch.fetch().histograms[("act", "x")]
    assert hist.max == 7.0


def test_stat_batch_fetches_in_one_host_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = StatBatch(4)
    batch.start()
    for i in range(5):
        batch.add(("act", f"layer{i}"), torch.randn(10), histogram=True)
        batch.add(("act", f"layer{i}"), torch.randn(3))
    batch.add_scalar(("ratio", "w"), torch.tensor(0.5))
    calls: list[str] = []
    for name in ("cpu", "tolist", "item", "numpy", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k)
        )
    fetched = batch.fetch()
    assert calls == ["cpu", "tolist"]  # one copy to the host, then read as numbers there
    assert len(fetched.states) == 5
    assert fetched.states[("act", "layer0")].numel == 13
    assert fetched.histograms[("act", "layer0")].num == 10
    assert fetched.scalars == {("ratio", "w"): 0.5}
    assert fetched.stats[("act", "layer0")] == pytest.approx(list(derive(fetched.states[("act", "layer0")]).values()))


def test_fetch_pools_chosen_groups_across_processes_with_sum_and_max() -> None:
    # Two "processes" simulated by one: every collective sees this process's table and a peer's.
    peer = states([torch.tensor([-9.0, 1.0])])
    ops: list[str] = []

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        ops.append(op)
        other = peer[:, :-1] if op == "sum" else peer[:, -1:]
        return tensor + other if op == "sum" else torch.maximum(tensor, other)

    batch = StatBatch()
    batch.start()
    batch.add(("out", "fc"), torch.tensor([2.0, 3.0]))
    batch.add(("param", "fc.weight"), torch.tensor([4.0]))
    fetched = batch.fetch(Across(frozenset({"out"}), lambda keys: keys, reduce))
    assert ops == ["sum", "max"]
    assert derive(fetched.states[("out", "fc")]) == pytest.approx(reference(torch.tensor([2.0, 3.0, -9.0, 1.0])))
    assert fetched.states[("param", "fc.weight")] == state(torch.tensor([4.0]))


def test_a_key_only_another_process_saw_is_pooled_as_empty_here() -> None:
    batch = StatBatch()
    batch.start()
    batch.add(("out", "a"), torch.ones(3))
    fetched = batch.fetch(Across(frozenset({"out"}), lambda keys: [*keys, ("out", "b")], lambda t, op: t))
    assert fetched.states[("out", "b")].numel == 0
    assert fetched.states[("out", "a")].numel == 3


def test_closed_batch_takes_nothing() -> None:
    batch = StatBatch()
    batch.add(("act", "late"), torch.ones(2))
    batch.start()
    batch.add(("act", "x"), torch.ones(2))
    assert list(batch.fetch().states) == [("act", "x")]
    batch.add(("act", "late"), torch.ones(2))
    batch.add_vector(("units", "late"), torch.ones(2))
    batch.start()
    assert batch.fetch() == ({}, {}, {}, {}, {}, {})


MIXED = [
    seeded(64, 3, seed=1),
    seeded(5, seed=2).bfloat16(),
    seeded(7, 2, seed=3).half(),
    torch.zeros(0),
    torch.zeros(0).bfloat16(),
    torch.tensor([1.0, math.inf, -math.inf, math.nan, 0.0, -3.0]),
    torch.tensor([math.inf, 2.0]).bfloat16(),
    torch.tensor([0.0, 0.0, 2.0, -3.0]),
    1000 + 1e-3 * seeded(4096, seed=5),
    seeded(6, seed=4).double(),
    seeded(3, 3, seed=6).requires_grad_(),
]


def test_add_many_equals_one_add_per_tensor() -> None:
    many, single = StatBatch(), StatBatch()
    many.start()
    single.start()
    keys = [("param", str(i)) for i in range(len(MIXED))]
    many.add_many(keys, MIXED)
    for key, t in zip(keys, MIXED, strict=True):
        single.add(key, t)
    got, expected = many.fetch().states, single.fetch().states
    assert list(got) == keys
    for key, t in zip(keys, MIXED, strict=True):
        a, b = derive(got[key]), derive(expected[key])
        assert a.keys() == b.keys()
        for stat, value in b.items():
            assert a[stat] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), (t.dtype, stat)


def top_level_ops(parameters: int) -> Counter[str]:
    """Operators dispatched (not those a fused operator runs inside) for one logging step's parameter statistics."""
    model = nn.ModuleList(nn.Linear(3, 3) for _ in range(parameters // 2))
    for layer in model[: parameters // 8]:
        layer.bfloat16()  # two groups: float32 and bfloat16
    sum(layer(torch.ones(2, 3, dtype=layer.weight.dtype)).float().sum() for layer in model).backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    batch = StatBatch()
    batch.start()
    with HookHandles() as handles, profile(activities=[ProfilerActivity.CPU]) as profiler:
        ParamGradRecorder(batch, update_ratio=True).record(list(model.named_parameters()), optimizer, handles)
        optimizer.step()
        fetched = batch.fetch()
    assert len(fetched.states) == len(fetched.scalars) == parameters
    return Counter(e.name for e in profiler.events() if e.cpu_parent is None)


def test_parameter_statistics_take_as_many_operators_for_400_tensors_as_for_50() -> None:
    few, many = top_level_ops(50), top_level_ops(400)
    assert many == few
    # Four matrices of rows (two shapes in two dtypes), the update ratios and the pooling; per-tensor
    # reductions take about 18 per tensor: 916 and 7,216.
    assert sum(few.values()) < 120


def test_vectors_pool_by_sum_over_calls_and_processes_in_the_one_transfer() -> None:
    batch = StatBatch()
    batch.start()
    batch.add_vector(("units", "relu"), torch.tensor([0.0, 2.0, 1.0]))
    batch.add_vector(("units", "relu"), torch.tensor([0.0, 1.0, 0.0]))  # a second call of the module
    batch.add_vector(("ring", "loss"), torch.tensor([0.5, 0.25]))  # not pooled across processes
    agreed: list[list[tuple[object, ...]]] = []

    def agree(keys: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
        agreed.append(keys)
        return [*keys, ("units", "other", 2)]  # a vector only another process had

    fetched = batch.fetch(Across(frozenset({"units"}), agree, lambda t, op: t * 2))  # two processes alike
    assert fetched.vectors == {
        ("ring", "loss"): [0.5, 0.25],
        ("units", "relu"): [0.0, 6.0, 2.0],
        ("units", "other"): [0.0, 0.0],
    }
    assert len(agreed) == 1  # one agreement for states and vectors


ROWS = [  # several tensors of one shape, so that buckets hold more than one row
    *(seeded(4, 6, seed=10 + i) * (i + 1) + i for i in range(5)),
    torch.tensor([[0.0, math.nan, 2.0], [math.inf, 0.0, -1.0]]),
    torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).bfloat16(),
    seeded(2, 3, seed=20).double(),
    torch.relu(seeded(2, 3, seed=21)),
    1000 + 1e-3 * seeded(2, 3, seed=22),  # the spread is taken around the row's mean
    torch.tensor([[-math.inf, 1.0, 1.0], [1.0, 1.0, 1.0]]).half(),
]


@pytest.mark.parametrize(
    ("row_max", "slab_bytes", "slabs_open"),
    [(1 << 15, 1 << 20, 16), (1 << 15, 200, 16), (1 << 15, 1 << 20, 1), (10, 1, 16)],
)
def test_queued_rows_equal_the_per_tensor_path(
    monkeypatch: pytest.MonkeyPatch, row_max: int, slab_bytes: int, slabs_open: int
) -> None:
    # 200 bytes: two [4, 6] rows a slab, full and reduced while tensors are still being added; one slab open: each new
    # shape reduces the slab of the one before; 1 byte: slabs of one row each; row_max=10: [4, 6] is reduced at once
    monkeypatch.setattr(_stats, "ROW_MAX", row_max)
    monkeypatch.setattr(_stats, "SLAB_BYTES", slab_bytes)
    monkeypatch.setattr(_stats, "SLABS_OPEN", slabs_open)
    tensors = [*ROWS, *MIXED]
    batch = StatBatch()
    batch.start()
    batch.add(("act", "0"), tensors[0])
    batch.add_many([("act", str(i)) for i in range(1, 5)], tensors[1:5])  # of one shape: they fill a started slab
    for i, t in enumerate(tensors[5:], 5):
        batch.add(("act", str(i)), t)
    got = batch.fetch().states
    assert list(got) == [("act", str(i)) for i in range(len(tensors))]  # call order kept
    for i, t in enumerate(tensors):
        a, b = got["act", str(i)], state(t)  # state: the per-tensor path
        expected = derive(b)
        assert derive(a).keys() == expected.keys()
        for stat, value in expected.items():
            assert derive(a)[stat] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), (i, t.dtype, stat)
        assert (a.numel, a.nonzero, a.nonfinite) == (b.numel, b.nonzero, b.nonfinite)  # counts are exact


def test_the_copies_waiting_for_their_reduction_are_bounded() -> None:
    batch = StatBatch()
    batch.start()
    for i in range(3 * _stats.SLABS_OPEN):  # one small tensor of each of many shapes
        batch.add(("act", str(i)), torch.ones(i + 1))
        assert len(batch._slabs) <= _stats.SLABS_OPEN  # at most 16 MB of slabs, whatever the model
    got = batch.fetch().states
    assert [got["act", str(i)].numel for i in range(3 * _stats.SLABS_OPEN)] == [
        i + 1.0 for i in range(3 * _stats.SLABS_OPEN)
    ]


def test_queued_rows_pool_calls_of_one_key_with_the_others() -> None:
    batch = StatBatch()
    batch.start()
    small, large = seeded(3, 4, seed=30), seeded(_stats.ROW_MAX + 1, seed=31)  # queued, and reduced at once
    for t in (small, large, small * -2):
        batch.add(("act", "twice"), t)
    batch.add(("out", "other"), small)
    got = batch.fetch().states
    expected = derive(state(torch.cat([small.flatten(), large, -2 * small.flatten()])))
    assert derive(got["act", "twice"]) == pytest.approx(expected, rel=1e-5)
    assert got["out", "other"] == pytest.approx(state(small))


def test_a_queued_tensor_is_a_copy_that_later_in_place_ops_do_not_change() -> None:
    batch = StatBatch()
    batch.start()
    x = torch.arange(8.0)
    batch.add(("act", "x"), x)
    x.mul_(-100)  # an in-place ReLU, or autograd reusing a gradient buffer, after the hook
    assert derive(batch.fetch().states["act", "x"]) == pytest.approx(derive(state(torch.arange(8.0))))


def test_histograms_of_equal_and_unequal_lengths_equal_one_at_a_time() -> None:
    values = [seeded(50, seed=40 + i) * (i + 1) for i in range(4)]
    values += [torch.tensor([math.nan, 1.0, -math.inf]), torch.zeros(0), seeded(7, seed=45).double(), torch.ones(3)]
    batch = StatBatch(8)
    batch.start()
    for i, v in enumerate(values):
        batch.add(("act", str(i)), v, histogram=True)
    together = batch.fetch().histograms
    for i, v in enumerate(values):
        if v.numel():
            got, expected = together["act", str(i)], Histogram.of(histogram(v.float(), 8).tolist())
            assert (got.min, got.max, got.num, got.bucket_counts) == (
                expected.min,
                expected.max,
                expected.num,
                expected.bucket_counts,
            )
            assert (got.sum, got.sum_squares) == pytest.approx((expected.sum, expected.sum_squares), rel=1e-6)


def activation_ops(layers: int) -> Counter[str]:
    """Operators dispatched (top level) by a logging step's activation statistics of ``layers`` tanh layers."""
    model = nn.Sequential(*(nn.Tanh() for _ in range(layers)))
    batch = StatBatch()
    batch.start()
    with HookHandles() as handles:
        ActivationRecorder(batch).attach(list(model.named_children()), handles)
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            model(torch.ones(4, 8))
            fetched = batch.fetch()
    assert len(fetched.states) == layers
    ops = Counter(e.name for e in profiler.events() if e.cpu_parent is None)
    assert ops.pop("aten::tanh") == layers  # the model's own
    return ops


def test_activation_statistics_take_one_copy_per_tensor_and_a_logarithmic_number_of_reductions() -> None:
    few, many = activation_ops(50), activation_ops(400)
    each = Counter({"aten::detach": 1, "aten::slice": 1, "aten::copy_": 1})  # a float32 copy into the slab
    rest_few = sum((few - Counter({op: 50 for op in each})).values())
    rest_many = sum((many - Counter({op: 400 for op in each})).values())
    assert many["aten::copy_"] - few["aten::copy_"] == 350  # one copy per output
    # slabs of 8, 16, 32 rows hold 50 outputs; 400 need three more slabs, each reduced with about 30 operators
    assert rest_many - rest_few <= 3 * 30
    assert rest_few <= 150


def test_the_tensor_taken_last_is_not_kept_alive() -> None:
    batch = StatBatch()
    batch.start()
    logits = seeded(_stats.ROW_MAX + 1, seed=80)  # large: observed at once, so nothing of it needs keeping
    alive = weakref.ref(logits)
    batch.add(("act", "head"), logits)
    del logits
    assert alive() is None
    assert batch.fetch().states["act", "head"].numel == _stats.ROW_MAX + 1


class Count(TorchDispatchMode):
    """The operators dispatched while held that are not views (each a kernel launch on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_large_tensor_met_again_unchanged_is_reduced_once_and_changed_in_place_again() -> None:
    # A container returns its last child's output and an addition hands one gradient to both its inputs, so the
    # same tensor reaches a batch under several keys (GPT-2: 63 of its 302 outputs and output gradients).
    t = seeded(_stats.ROW_MAX + 1, seed=81)
    expected = t.double()
    batch = StatBatch()
    batch.start()
    with Count() as counted:
        batch.add(("act", "mlp.dropout"), t)
        first = len(counted.ops)
        batch.add(("act", "mlp"), t)
        assert len(counted.ops) == first  # its rows again, no operator
        t.mul_(2)  # a new version: reduced anew
        batch.add(("act", "scaled"), t)
        assert len(counted.ops) > 2 * first
    states = batch.fetch().states
    assert states["act", "mlp"] == states["act", "mlp.dropout"]
    for key, scale in (("mlp", 1), ("scaled", 2)):
        assert states["act", key].sum == pytest.approx(float(scale * expected.sum()), rel=1e-6, abs=1e-3)
        assert states["act", key].sum_sq == pytest.approx(float((scale * expected).square().sum()), rel=1e-6)


def test_a_large_tensor_is_reduced_in_a_few_operators_and_made_a_state_with_the_others() -> None:
    # On an accelerator each operator that is not a view is a kernel launch, and a logging step takes hundreds of
    # tensors: a few fused reductions per tensor, and the float64 states made once for them all at fetch.
    tensors = [torch.randn(3, 40_000) for _ in range(4)]  # each larger than a slab row: reduced when taken
    batch = StatBatch()
    batch.start()
    with Count() as counted:
        for i, t in enumerate(tensors):
            batch.add(("act", str(i)), t)
    # 17 each before #30; 11 until the spread's squares were summed pairwise rather than normed (a CPU's norm is
    # off by 1e-3 at 2**23 values): 12
    assert len(counted.ops) <= 12 * len(tensors), Counter(counted.ops)
    fetched = batch.fetch()
    for i, t in enumerate(tensors):
        assert fetched.states[("act", str(i))].sum_sq == pytest.approx(float((t.double() ** 2).sum()), rel=1e-5)
        assert fetched.states[("act", str(i))].sum == pytest.approx(float(t.double().sum()), abs=1e-2)


@pytest.mark.parametrize("n", [1 << 20, CHUNK + 128])
def test_the_spread_of_a_long_row_is_float64s(n: int) -> None:
    # Non-negative values (a ReLU's), whose mean is far from zero: torch's CPU vector norm of the centred row was
    # off by 8e-5 at 2**20 values and 1.8e-3 at 2**23.
    x = torch.relu(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    exact = x.double()
    got = derive(state(x), ["norm", "mean", "std"])
    want = {"norm": exact.norm().item(), "mean": exact.mean().item(), "std": exact.std(correction=0).item()}
    assert got == pytest.approx(want, rel=1e-6)

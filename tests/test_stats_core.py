import math

import pytest
import torch

from lightning_hooks._stats import HIST_SAMPLE, STATS, StatBatch, combine, derive, histogram, moments


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


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 5 + 3,
        torch.relu(torch.randn(64, 32, generator=torch.Generator().manual_seed(1))),
        torch.full((7,), 2.5),
        torch.tensor([1.0]),
        torch.randn(3, 4, generator=torch.Generator().manual_seed(2)).half(),
        torch.arange(10),
    ],
    ids=["shifted", "relu", "constant", "single", "half", "int"],
)
def test_moments_give_the_reference_statistics(tensor: torch.Tensor) -> None:
    got = derive(moments(tensor).row())
    for name, value in reference(tensor).items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_nonfinite_values_are_counted() -> None:
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0])
    got = derive(moments(t).row())
    assert got["nonfinite"] == 3
    assert got["zero_frac"] == pytest.approx(0.2)
    assert math.isnan(got["mean"])


def test_combined_rows_equal_the_concatenation() -> None:
    generator = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, generator=generator) * (i + 1) + i for i, n in enumerate((10, 300, 1))]
    got = derive(combine([moments(p).row() for p in parts]))
    for name, value in reference(torch.cat(parts)).items():
        assert got[name] == pytest.approx(value, rel=1e-5), name


def test_empty_tensor_gives_no_statistics() -> None:
    assert derive(moments(torch.zeros(0)).row()) == {}


def test_histogram_matches_histc_and_skips_nonfinite() -> None:
    t = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    row = histogram(torch.cat([t, torch.tensor([float("nan"), float("inf")])]), 20).tolist()
    lo, hi, num = row[:3]
    assert (lo, hi) == (pytest.approx(float(t.min())), pytest.approx(float(t.max())))
    assert num == 5000
    expected = torch.histc(t.double(), bins=20, min=lo, max=hi)
    assert row[5:] == pytest.approx(expected.tolist(), abs=1)  # edge values may fall either side
    assert sum(row[5:]) == 5000


def test_histogram_samples_large_tensors() -> None:
    row = histogram(torch.ones(HIST_SAMPLE * 3 + 1), 8).tolist()
    assert row[2] <= HIST_SAMPLE


def test_stat_batch_fetches_in_one_host_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = StatBatch()
    batch.start()
    for i in range(5):
        batch.add_moments(("act", f"layer{i}"), moments(torch.randn(10)))
        batch.add_moments(("act", f"layer{i}"), moments(torch.randn(3)))
        batch.add_histogram(("act", f"layer{i}"), histogram(torch.randn(10), 4))
    batch.add_scalar(("ratio", "w"), torch.tensor(0.5))
    calls: list[str] = []
    for name in ("cpu", "tolist", "item", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k)
        )
    rows, hists, extra = batch.fetch()
    assert calls == ["tolist"]
    assert len(rows) == 5
    assert rows[("act", "layer0")][0] == 13
    assert len(hists) == 5
    assert extra == {("ratio", "w"): 0.5}
    assert len(batch) == 0


def test_closed_batch_takes_nothing() -> None:
    batch = StatBatch()
    batch.add_moments(("act", "late"), moments(torch.ones(2)))
    assert len(batch) == 0
    batch.start()
    batch.add_moments(("act", "x"), moments(torch.ones(2)))
    batch.fetch()
    batch.add_moments(("act", "late"), moments(torch.ones(2)))
    assert len(batch) == 0


def test_stats_names() -> None:
    assert STATS == ("norm", "mean", "std", "abs_max", "zero_frac", "nonfinite")


def test_a_tiny_spread_around_a_large_mean_keeps_its_precision() -> None:
    t = 1000 + 1e-3 * torch.randn(4096, generator=torch.Generator().manual_seed(5))
    assert derive(moments(t).row())["std"] == pytest.approx(reference(t)["std"], rel=1e-3)


def test_combining_a_row_with_a_nan_abs_max_keeps_the_nan() -> None:
    rows = [moments(torch.tensor([1.0, float("nan")])).row(), moments(torch.tensor([5.0])).row()]
    assert math.isnan(combine(rows)[3])
    assert combine(list(reversed(rows)))[3] != combine(list(reversed(rows)))[3]
    assert combine([moments(torch.tensor([1.0, -7.0])).row(), moments(torch.tensor([5.0])).row()])[3] == 7.0

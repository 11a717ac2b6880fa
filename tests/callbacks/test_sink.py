"""How scalars reach the loggers: one event per step for TensorBoard, log_metrics for the rest."""

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from lightning_hooks import ActivationStats
from tests.support.helpers import TinyNet, events, make_trainer, scalars


def step_events(root: Path, plugin: str = "scalars") -> list[tuple[int, list[str]]]:
    """The step and the tags of each event of the run holding ActivationStats' values for ``plugin``, in file
    order (TensorBoard's loader, which reads each value as its plugin's tensor)."""
    (path,) = root.rglob("events.out.tfevents.*")
    found = []
    for event in EventFileLoader(str(path)).Load():
        values = event.summary.value
        tags = [v.tag for v in values if v.metadata.plugin_data.plugin_name == plugin and v.tag.startswith("act")]
        if tags:
            found.append((event.step, tags))
    return found


def scalar_events(root: Path) -> list[list[str]]:
    return [tags for _, tags in step_events(root)]


def test_a_logging_step_writes_all_its_scalars_as_one_tensorboard_event(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ActivationStats()], max_steps=5).fit(TinyNet())
    written = scalar_events(tmp_path)
    assert len(written) == 3  # steps 0, 2, 4
    assert len(written[0]) == len(set(written[0])) >= 10  # every statistic of every layer, once
    assert scalars(tmp_path, "act_mean/fc1").keys() == {0, 2, 4}


def test_a_logging_step_writes_all_its_histograms_as_one_tensorboard_event(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ActivationStats(histograms=True)], max_steps=5).fit(TinyNet())
    written = step_events(tmp_path, "histograms")
    assert [step for step, _ in written] == [0, 2, 4]
    assert all(tags == written[0][1] for _, tags in written)
    assert {"act/fc1", "act/fc2", "act/act"} <= set(written[0][1])
    read = events(tmp_path).Histograms("act/fc1")
    assert [(e.step, e.histogram_value.num) for e in read] == [(0, 128), (2, 64), (4, 128)]  # fc1's 8 outputs a row
    for e in read:
        hist = e.histogram_value
        assert sum(hist.bucket) == hist.num
        assert hist.min < hist.max
        assert list(hist.bucket_limit) == sorted(hist.bucket_limit)
        assert hist.bucket_limit[-1] == pytest.approx(hist.max)


class OddSteps(TinyNet):
    """``unused`` runs on odd steps only (on the first column pair of the input): the tags of a step change."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.unused(x[:, :2]).sum() * 0 if self.global_step % 2 else out


def test_steps_with_other_tags_get_their_own_events(tmp_path: Path) -> None:
    make_trainer(tmp_path, [ActivationStats(log_every_n_steps=1)], max_steps=4, log_every_n_steps=1).fit(OddSteps())
    written = scalar_events(tmp_path)
    assert ["act_mean/unused" in tags for tags in written] == [False, True, False, True]
    assert len(written[1]) == len(written[0]) + 5  # the five statistics of `unused`
    means = scalars(tmp_path, "act_mean/fc1")
    assert means.keys() == {0, 1, 2, 3}
    assert len(set(means.values())) == 4  # each step's own values, not the event's earlier ones
    assert scalars(tmp_path, "act_mean/unused").keys() == {1, 3}


def test_the_tensorboard_logger_prefix_is_kept(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb", version=0, prefix="probe")
    make_trainer(tmp_path, [ActivationStats(histograms=True)], max_steps=3, logger=logger).fit(TinyNet())
    tags = events(tmp_path).Tags()
    assert "probe-act_mean/fc1" in tags["scalars"]
    assert "act_mean/fc1" not in tags["scalars"]
    assert "act/fc1" in tags["histograms"]  # as Lightning's own TensorBoardLogger: the prefix is for metrics only


class RecordingTensorBoardLogger(TensorBoardLogger):
    """A subclass with its own log_metrics: it must still be called."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.calls: list[tuple[int | None, set[str]]] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.calls.append((step, set(metrics)))
        super().log_metrics(metrics, step)


@pytest.mark.parametrize("kind", ["tensorboard subclass", "csv"])
def test_other_loggers_get_the_same_scalars_through_log_metrics(tmp_path: Path, kind: str) -> None:
    if kind == "csv":
        logger: TensorBoardLogger | CSVLogger = CSVLogger(tmp_path, name="csv", version=0)
    else:
        logger = RecordingTensorBoardLogger(tmp_path, name="tb", version=0)
    make_trainer(tmp_path, [ActivationStats()], max_steps=3, logger=logger).fit(TinyNet())
    if isinstance(logger, RecordingTensorBoardLogger):
        ours = [(step, tags) for step, tags in logger.calls if "act_mean/fc1" in tags]
        assert [step for step, _ in ours] == [0, 2]
        assert scalars(tmp_path, "act_mean/fc1").keys() == {0, 2}
    else:
        header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
        assert "act_mean/fc1" in header.split(",")

"""Every Lightning logger gets what it can show: one real fit writes to TensorBoard, W&B (offline),
MLflow (a local file store) and CSV at once, and each is read back with its own reader."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import nn

from benchmarks.overhead import SyncCounter
from lightning_hooks import ActivationStats, GradStats, HealthMonitor, NonFiniteGuard, ShapeLogger
from lightning_hooks.sinks.backends import mlflow_key
from lightning_hooks.sinks.sink import Sink
from tests.support.helpers import TinyNet, events, make_trainer, scalars, texts

STEPS = 5  # stats and Lightning's loss at 0, 2, 4; figures at 0 and 4; shape tables at 0 and 2 (smaller last batch)
FIT = {"max_steps": STEPS, "log_every_n_steps": 2}
FC1_ROW = ["fc1", "Linear", "[16, 4]", "[16, 8]", "40"]
FINDINGS = (["layer", "finding"], [["act", "dead ReLU: 95 % zeros"], ["fc2.weight", "update ratio 0.3"]])


class Spike(nn.Module):
    """Multiplies by NaN while ``armed``: a layer that makes non-finite values from finite ones."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if self.armed else x


class LoggedNet(TinyNet):
    """TinyNet that logs its loss (Lightning's own metric) and makes a NaN at step 3, repaired after ``spike``."""

    def __init__(self) -> None:
        super().__init__()
        self.spike = Spike()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nan_to_num(self.spike(self.act(self.fc2(self.act(self.fc1(x)))))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.spike.armed = self.global_step == 3
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


class Findings(pl.Callback):
    """Sends a findings table at step 1 the way a health monitor would: through its sink."""

    def __init__(self) -> None:
        self.sink = Sink("Findings")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            self.sink.table(trainer, "health/findings", *FINDINGS, step=1)


def callbacks() -> list[pl.Callback]:
    return [
        ShapeLogger(),
        GradStats(histograms=True, output_grads=False, figure_every_n_steps=4),
        ActivationStats(histograms=True, figure_every_n_steps=4),
        NonFiniteGuard(action="skip_step"),
        Findings(),
    ]


def counted_fit(trainer: pl.Trainer) -> int:
    """Fit ``LoggedNet`` and return how many times the host waited for a tensor's value."""
    counter = SyncCounter()
    with counter.counting():
        trainer.fit(LoggedNet())
    return counter.count


def quiet_wandb(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Offline, silent, and every file W&B writes (caches, artifact staging) under ``root``."""
    monkeypatch.setenv("WANDB_MODE", "offline")  # first, so that undoing it also undoes WandbLogger's own setting
    for name, value in {
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_CACHE_DIR": str(root / "cache"),
        "WANDB_CONFIG_DIR": str(root / "config"),
        "WANDB_DATA_DIR": str(root / "data"),
        "WANDB_ARTIFACT_DIR": str(root / "artifacts"),
    }.items():
        monkeypatch.setenv(name, value)


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """Every row of an offline run's history, read from its ``.wandb`` file with wandb's own reader."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "WANDB_SILENT": "true"},
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


@dataclass
class Run:
    root: Path
    history: list[dict[str, Any]]
    """W&B's rows, in logging order."""
    wandb_files: Path
    mlflow: Any
    """An ``MlflowClient`` on the run's store."""
    run_id: str
    csv_dir: Path
    syncs: int
    warnings: list[str]
    """Every warning lightning_hooks gave during the fit."""

    def rows_with(self, key: str) -> dict[int, dict[str, Any]]:
        """W&B rows holding ``key``, by ``trainer/global_step``."""
        rows = [row for row in self.history if key in row or f"{key}._type" in row]
        steps = [row["trainer/global_step"] for row in rows]
        assert len(steps) == len(set(steps)), f"{key} logged twice at one step: {steps}"
        return dict(zip(steps, rows, strict=True))

    def artifact(self, path: str) -> Path:
        return Path(self.mlflow.download_artifacts(self.run_id, path, str(self.root / "downloads")))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """One fit of every callback with TensorBoard, W&B, MLflow and CSV loggers side by side."""
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (`pip install 'lightning-hooks[loggers]'`)")
    pytest.importorskip("mlflow", reason="mlflow is not installed (`pip install 'lightning-hooks[loggers]'`)")
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("loggers")
    with pytest.MonkeyPatch.context() as monkeypatch:
        quiet_wandb(monkeypatch, root)
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 refuses `file:` stores without it
        tracking = f"file:{root / 'mlruns'}"
        loggers = [
            TensorBoardLogger(root, name="tb", version=0),
            WandbLogger(offline=True, save_dir=str(root), project="lightning-hooks"),
            MLFlowLogger(experiment_name="lightning-hooks", tracking_uri=tracking),
            CSVLogger(root, name="csv", version=0),
        ]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            syncs = counted_fit(make_trainer(root, callbacks(), logger=loggers, **FIT))
        loggers[1].experiment.finish()
        (run_file,) = root.glob("wandb/offline-run-*/run-*.wandb")
        yield Run(
            root=root,
            history=wandb_history(run_file),
            wandb_files=run_file.parent / "files",
            mlflow=MlflowClient(tracking),
            run_id=str(loggers[2].run_id),
            csv_dir=root / "csv" / "version_0",
            syncs=syncs,
            warnings=[str(w.message) for w in caught if "lightning_hooks" in w.filename],
        )
        assert wandb.run is None


def test_wandb_gets_each_step_in_one_log_call_at_tensorboards_steps(run: Run) -> None:
    steps = sorted(scalars(run.root, "act_mean/fc1"))
    assert steps == [0, 2, 4]
    acts, grads = run.rows_with("act_mean/fc1"), run.rows_with("grad_norm/fc1.weight")
    assert sorted(acts) == sorted(grads) == steps
    for step, row in acts.items():  # scalars, histograms and the figure of a step: one row, one `log` call
        assert row["act_mean/fc1"] == pytest.approx(scalars(run.root, "act_mean/fc1")[step])
        assert row["act/fc1._type"] == "histogram"
        assert ("figures/activation_zero_frac._type" in row) == (step in (0, 4))
    assert all(row.get("grad/fc1.weight._type") == "histogram" for row in grads.values())
    assert sorted(run.rows_with("figures/gradient_flow")) == [0, 4]
    # Lightning's own metric keeps its steps too (it logs after steps 1 and 3), and W&B's counter only went up.
    assert sorted(run.rows_with("train_loss")) == sorted(scalars(run.root, "train_loss")) == [1, 3]
    assert [row["_step"] for row in run.history] == list(range(len(run.history)))


def test_wandb_histograms_are_our_device_counts(run: Run) -> None:
    (tb,) = [e for e in events(run.root).Histograms("act/fc1") if e.step == 2]
    row = run.rows_with("act/fc1")[2]
    values, bins = row["act/fc1.values"], row["act/fc1.bins"]
    assert sum(values) == tb.histogram_value.num
    assert len(bins) == len(values) + 1
    assert bins[0] == pytest.approx(tb.histogram_value.min)
    assert bins[-1] == pytest.approx(tb.histogram_value.max)


def wandb_table(run: Run, row: Mapping[str, Any], key: str) -> dict[str, Any]:
    assert row[f"{key}._type"] == "table-file"
    table: dict[str, Any] = json.loads((run.wandb_files / row[f"{key}.path"]).read_text())
    return table


def test_wandb_tables_hold_one_row_per_module_call_and_per_finding(run: Run) -> None:
    shapes = run.rows_with("shapes/train")
    assert sorted(shapes) == [0, 2]
    first = wandb_table(run, shapes[0], "shapes/train")
    assert first["columns"] == ["Layer", "Type", "Input", "Output", "Params"]
    assert [r[0] for r in first["data"]] == ["root", "fc1", "act", "fc2", "act", "spike", "head"]
    assert first["data"][1] == FC1_ROW
    assert wandb_table(run, shapes[2], "shapes/train")["data"][1][2] == "[8, 4]"
    findings = wandb_table(run, run.rows_with("health/findings")[1], "health/findings")
    assert findings == {**findings, "columns": FINDINGS[0], "data": FINDINGS[1]}
    report = run.rows_with("nonfinite/first_layer")[3]
    lines = [cell for (cell,) in wandb_table(run, report, "nonfinite/first_layer")["data"]]
    assert any("`spike` (Spike)" in line for line in lines)
    assert run.rows_with("nonfinite/skipped_steps")[3]["nonfinite/skipped_steps"] == 1


def test_mlflow_gets_metrics_at_tensorboards_steps_figures_histograms_and_markdown(run: Run) -> None:
    client, run_id = run.mlflow, run.run_id
    for tag in ("act_mean/fc1", "grad_norm/fc1.weight", "train_loss"):
        history = {m.step: m.value for m in client.get_metric_history(run_id, tag)}
        assert history == pytest.approx(scalars(run.root, tag))
    assert [m.step for m in client.get_metric_history(run_id, "nonfinite/skipped_steps")] == [3]
    figures = [f.path for f in client.list_artifacts(run_id, "figures/gradient_flow")]
    assert figures == ["figures/gradient_flow/step_0.png", "figures/gradient_flow/step_4.png"]
    png = run.artifact("figures/activation_zero_frac/step_4.png").read_bytes()
    tb_image = events(run.root).Images("figures/activation_zero_frac")[-1]
    assert png.startswith(b"\x89PNG")
    assert int.from_bytes(png[16:20], "big") == tb_image.width
    stored = json.loads(run.artifact("histograms/step_2.json").read_text())
    assert stored["step"] == 2
    assert {"grad/fc1.weight", "act/fc1"} <= set(stored["histograms"])  # both callbacks' histograms in one file
    (tb,) = [e for e in events(run.root).Histograms("act/fc1") if e.step == 2]
    assert stored["histograms"]["act/fc1"]["num"] == tb.histogram_value.num
    assert stored["histograms"]["act/fc1"]["bucket_counts"] == pytest.approx(list(tb.histogram_value.bucket))
    shapes = run.artifact("shapes/train.md").read_text()
    assert shapes.startswith("## step 0\n\n**LoggedNet · step 0 · batch 0: [16, 4], 1: [16]**\n\n| Layer |")
    assert "\n## step 2\n" in shapes
    assert f"| {' | '.join(FC1_ROW)} |" in shapes
    assert texts(run.root, "shapes/train")[0] in shapes  # the same markdown as TensorBoard's
    assert "`spike` (Spike)" in run.artifact("nonfinite/first_layer.md").read_text()
    assert "| act | dead ReLU: 95 % zeros |" in run.artifact("health/findings.md").read_text()


def test_csv_gets_scalars_and_markdown_files_in_its_log_dir(run: Run) -> None:
    lines = (run.csv_dir / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    step, act = header.index("step"), header.index("act_mean/fc1")
    assert [int(r.split(",")[step]) for r in lines[1:] if r.split(",")[act]] == [0, 2, 4]
    # One row per logging step holds every callback's scalars of that step (not a sparse row from each).
    grad, skipped = header.index("grad_norm/fc1.weight"), header.index("nonfinite/skipped_steps")
    rows = [r.split(",") for r in lines[1:]]
    assert [int(r[step]) for r in rows if r[grad]] == [0, 2, 4]
    assert all(r[act] for r in rows if r[grad])
    assert [r[act] != "" for r in rows if r[skipped]] == [False]  # step 3 skipped, not a logging step: its own row
    shapes = (run.csv_dir / "shapes" / "train.md").read_text()
    assert shapes == run.artifact("shapes/train.md").read_text()
    assert (run.csv_dir / "nonfinite" / "first_layer.md").read_text().startswith("## step 3\n")
    assert (run.csv_dir / "health" / "findings.md").exists()
    assert sorted(p.name for p in run.csv_dir.iterdir()) == ["health", "metrics.csv", "nonfinite", "shapes"]


def test_known_loggers_cost_no_warning(run: Run) -> None:
    # Only what the fit itself calls for: the layer that never runs, and the guard's finding.
    assert len(run.warnings) == 2
    assert run.warnings[0].startswith("`NonFiniteGuard` found NaN/Inf values at step 3")
    assert "never ran in any training step they recorded" in run.warnings[1]  # said when training ends


def test_more_loggers_make_no_more_host_transfers(run: Run, tmp_path: Path) -> None:
    alone = counted_fit(make_trainer(tmp_path, callbacks(), **FIT))
    assert run.syncs == alone


class Recorder(Logger):
    """A logger lightning_hooks does not know."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[int, set[str]] = {}

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.logged.setdefault(step or 0, set()).update(metrics)


def test_an_unknown_logger_gets_scalars_and_one_warning_naming_what_it_does_not(tmp_path: Path) -> None:
    logger = Recorder()
    stats = [ActivationStats(histograms=True), GradStats(histograms=True)]
    with pytest.warns(UserWarning, match="`Recorder` is not a logger lightning_hooks knows") as record:
        make_trainer(tmp_path, [ShapeLogger(), *stats], logger=logger, max_steps=3).fit(TinyNet())
    mine = [str(w.message) for w in record if "lightning_hooks" in w.filename and "never ran" not in str(w.message)]
    assert len(mine) == 1
    assert "`Recorder` is not a logger lightning_hooks knows" in mine[0]
    assert "it gets scalars only, through its `log_metrics`, and no histograms, figures, text or tables" in mine[0]
    assert {"act_mean/fc1", "grad_norm/fc1.weight"} <= logger.logged[0]
    assert sorted(step for step, tags in logger.logged.items() if "act_mean/fc1" in tags) == [0, 2]


def test_fast_dev_run_whose_logger_drops_everything_costs_no_warning(tmp_path: Path) -> None:
    # `fast_dev_run` swaps the Trainer's loggers for Lightning's DummyLogger. Before, every callback that logs tables
    # or histograms warned that `DummyLogger` "gets scalars only", on the run a newcomer tries first.
    callbacks = [ShapeLogger(), ActivationStats(histograms=True), GradStats(histograms=True), HealthMonitor()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, callbacks, fast_dev_run=2)
        trainer.fit(TinyNet())
    assert type(trainer.logger).__name__ == "DummyLogger"
    assert trainer.global_step == 2
    mine = [str(w.message) for w in caught if "lightning_hooks" in w.filename and "never ran" not in str(w.message)]
    assert mine == []


def test_mlflow_markdown_goes_on_in_a_resumed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="mlflow is not installed (`pip install 'lightning-hooks[loggers]'`)")
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracking = f"file:{tmp_path / 'mlruns'}"
    first = MLFlowLogger(tracking_uri=tracking)
    make_trainer(tmp_path, [ShapeLogger()], logger=first, max_steps=1).fit(TinyNet())
    again = MLFlowLogger(tracking_uri=tracking, run_id=first.run_id)
    make_trainer(tmp_path, [ShapeLogger()], logger=again, max_steps=1).fit(TinyNet())
    path = again.experiment.download_artifacts(first.run_id, "shapes/train.md", str(tmp_path))
    assert Path(path).read_text().count("## step 0\n") == 2


class Halves(nn.Module):
    """Returns a dict whose key MLflow cannot take as it is."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pos:part": x.clamp(min=0), "neg": x.clamp(max=0)}


class HalvesNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.halves = Halves()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.halves(self.fc1(x))["pos:part"]))


def test_mlflow_gets_a_tag_it_cannot_take_under_a_key_it_can_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="mlflow is not installed (`pip install 'lightning-hooks[loggers]'`)")
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    logger = MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    stats = ActivationStats(include=["halves"], stats=["mean"], log_every_n_steps=1)
    with pytest.warns(UserWarning, match="`MLFlowLogger`: MLflow metric keys may only hold") as record:
        make_trainer(tmp_path, [stats], logger=logger, max_steps=2).fit(HalvesNet())
    renamed = [str(w.message) for w in record if "MLflow metric keys" in str(w.message)]
    assert len(renamed) == 1
    assert "`act_mean/halves.out.pos:part` → `act_mean/halves.out.pospart`" in renamed[0]
    for key in ("act_mean/halves.out.pospart", "act_mean/halves.out.neg"):
        assert [m.step for m in logger.experiment.get_metric_history(str(logger.run_id), key)] == [0, 1]


def test_the_package_imports_wandb_and_mlflow_only_where_their_logger_is_written_to() -> None:
    package = Path(__file__).resolve().parents[2] / "lightning_hooks"
    for path in package.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level: what `import lightning_hooks` runs
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] in ("wandb", "mlflow")], f"{path.name}: {names}"


@pytest.mark.parametrize(
    ("tag", "key"),
    [
        ("act_mean/fc1", "act_mean/fc1"),
        ("grad_norm/encoder.layers.0.linear1.weight", "grad_norm/encoder.layers.0.linear1.weight"),
        ("act_mean/head.out.logits", "act_mean/head.out.logits"),
        ("act_mean/dec.out.a:b", "act_mean/dec.out.ab"),  # Lightning's MLFlowLogger drops ':' too
        ("act_mean/dec.out.x/", "act_mean/dec.out.x"),  # MLflow refuses a trailing slash
        ("act_mean/dec.out.a//b", "act_mean/dec.out.a/b"),
        ("act_mean/dec.out./../y", "act_mean/dec.out./y"),
    ],
)
def test_mlflow_keys_are_the_tags_where_mlflow_allows(tag: str, key: str) -> None:
    assert mlflow_key(tag) == key

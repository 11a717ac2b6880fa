"""Every YAML file in configs/ trains through the real LightningCLI (shortened)."""

from pathlib import Path

import pytest

from lightning_hooks.cli import main
from lightning_hooks.diagnose.health import CHECKS
from tests.support.helpers import events

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"digits.yaml", "numnet.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_runs(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "fit",
            f"--config={config}",
            "--trainer.max_steps=4",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
        ]
    )
    out = capsys.readouterr().out
    assert "ShapeLogger:" in out
    tags = events(tmp_path / "logs").Tags()
    assert "shapes/train" in tags["tensors"]
    assert "grad_clamp/clamped_fraction" in tags["scalars"]
    if config.stem == "digits":
        assert {"grad_norm_total", "act_zero_frac/features.2", "out_grad_norm/classifier.3"} <= set(tags["scalars"])
        assert "grad/features.0.weight" in tags["histograms"]
        assert "act/features.0" in tags["histograms"]
        assert {f"health/{check}" for check in CHECKS} <= set(tags["scalars"])
        assert "HealthMonitor: no problems found in 4 steps." in out

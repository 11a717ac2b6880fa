"""Fixtures and options shared across test files."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.tb_server import DIGITS_RUN, Server, tensorboard_server, train_digits, wait_for_run


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import matplotlib` fail as it does where the `plots` extra is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


@pytest.fixture(scope="session")
def digits_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short real run of configs/digits.yaml (every callback), with ``MemoryLogger`` added on the command line,
    logged under the returned folder.

    24 optimizer steps, logging every 2, so figures (every 10 logging periods) fall on steps 0 and 20.
    """
    root = tmp_path_factory.mktemp("digits")
    train_digits(
        root,
        "--trainer.max_steps=24",
        "--trainer.log_every_n_steps=2",
        "--trainer.limit_val_batches=2",
        "--trainer.callbacks+=lightning_hooks.MemoryLogger",
    )
    return root


@pytest.fixture(scope="session")
def tensorboard(digits_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real `tensorboard` server on the digits run, ready to answer; stopped at the end of the session."""
    with tensorboard_server(digits_logs, tmp_path_factory.mktemp("tensorboard")) as server:
        wait_for_run(server, DIGITS_RUN, {"grad_norm_total", "act_zero_frac/features.2"})
        yield server


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite the golden files under tests/support/golden/ from the current output instead of comparing",
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))

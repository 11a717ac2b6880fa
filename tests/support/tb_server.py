"""A real TensorBoard server and headless Chromium, for the server and browser tests and `make screenshot`.

Everything stays on the loopback interface: the server binds 127.0.0.1 on a free port, and every
request goes there. The server is a subprocess that is always stopped when its ``with`` block ends,
however it ends.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
DIGITS_RUN = "digits/version_0"
"""The run name TensorBoard gives a :func:`train_digits` fit (``<name>/<version>`` below the log directory)."""
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--hide-scrollbars",
)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """A running ``tensorboard`` subprocess and how to ask it things."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def get(self, path: str, **params: Any) -> bytes:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=30) as response:
            return bytes(response.read())

    def json(self, path: str, **params: Any) -> Any:
        return json.loads(self.get(path, **params))

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float = 60.0) -> None:
        """Poll ``ready`` (connection errors count as not ready) until it holds; fail with the server's log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tensorboard exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tensorboard did not show {what} within {timeout:.0f} s:\n{self.log.read_text()}")


def tensorboard_executable() -> str:
    """The ``tensorboard`` script next to this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("tensorboard")
    found = str(beside) if beside.exists() else shutil.which("tensorboard")
    if not found:
        raise FileNotFoundError("no `tensorboard` executable next to the Python interpreter or on PATH")
    return found


@contextmanager
def tensorboard_server(logdir: Path, workdir: Path) -> Iterator[Server]:
    """``tensorboard --logdir logdir --host 127.0.0.1 --port <free>``, stopped on exit whatever happens."""
    port = free_port()
    log = workdir / f"tensorboard-{port}.log"
    command = [tensorboard_executable(), "--logdir", str(logdir), "--host", HOST, "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Server(process, f"http://{HOST}:{port}", log)
    try:
        server.wait_for("/data/runs", lambda: isinstance(server.json("/data/runs"), list))
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_for_run(server: Server, run: str, scalar_tags: set[str]) -> None:
    """Until the server lists ``run`` with all of ``scalar_tags`` (it loads event files in the background)."""

    def ready() -> bool:
        tags = server.json("/data/plugin/scalars/tags")
        return scalar_tags <= set(tags.get(run, {}))

    server.wait_for(f"run {run!r} with its scalars", ready)


def chromium() -> str | None:
    """Debian's ``chromium`` (or ``chromium-browser``) on PATH, if installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(
    url: str, png: Path, profile: Path, *, size: tuple[int, int] = (1400, 1000), budget_ms: int = 15000
) -> subprocess.CompletedProcess[str]:
    """Headless Chromium loads ``url``, lets its scripts run for ``budget_ms`` of virtual time, saves ``png``."""
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("`chromium` is not on PATH (Debian: apt-get install chromium)")
    command = [
        browser,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--window-size={size[0]},{size[1]}",
        f"--virtual-time-budget={budget_ms}",
        f"--screenshot={png}",
        url,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)


def train_digits(root: Path, *extra: str) -> Path:
    """Fit ``configs/digits.yaml`` (all callbacks) through the real CLI, logging under ``root``; the run's folder."""
    from lightning_hooks.cli import main

    config = Path(__file__).parents[2] / "configs" / "digits.yaml"
    main(
        [
            "fit",
            f"--config={config}",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            *extra,
        ]
    )
    (run,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    return run

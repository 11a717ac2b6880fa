"""Instruction counts of chosen stretches of a Python process, taken with valgrind's callgrind.

Wall time on a shared 2-core VM scatters by 15-30 % from one fit to the next; the number of
instructions a step executes does not depend on what else the machine is doing. The parent
starts the measuring process under ``valgrind --tool=callgrind --instr-atstart=no``, so the
interpreter, the imports and the Trainer's set-up run uninstrumented (and much faster); the
child switches instrumentation on for the steps it wants counted and dumps the counter once
per step through callgrind's client requests, issued from a ten-line C library compiled on the
spot (outside valgrind the requests are no-ops). Every dump is read back and deleted at once.

Needs ``valgrind`` and a C compiler with valgrind's headers (Debian: ``valgrind``, ``gcc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

LIBRARY_ENV = "LIGHTNING_HOOKS_CALLGRIND_LIBRARY"
OUT_ENV = "LIGHTNING_HOOKS_CALLGRIND_OUT"

_SOURCE = r"""
#include <valgrind/callgrind.h>
void meter_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void meter_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
void meter_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
int meter_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""


def missing_tools() -> str | None:
    """Why instruction counts cannot be taken on this machine, or ``None`` when they can."""
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (Debian: apt-get install valgrind gcc)"
    if not any(Path(root, "valgrind", "callgrind.h").exists() for root in ("/usr/include", "/usr/local/include")):
        return "valgrind's header valgrind/callgrind.h is not installed (Debian: apt-get install valgrind)"
    return None


def require() -> None:
    """Exit with the reason when instruction counts cannot be taken on this machine."""
    if (why := missing_tools()) is not None:
        sys.exit(f"instruction counts need valgrind and a C compiler: {why}")


@contextlib.contextmanager
def workspace() -> Iterator[tuple[Path, Path]]:
    """``(directory, library)``: a scratch directory for the counting processes' dumps and logs, with the
    client-request library built in it; removed afterwards."""
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        yield directory, build_library(directory)


def build_library(directory: Path) -> Path:
    """Compile the client-request library into ``directory``."""
    source, library = directory / "meter.c", directory / "meter.so"
    source.write_text(_SOURCE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def command(python_args: list[str], out_dir: Path) -> list[str]:
    """The command line that runs ``python_args`` under callgrind, counting only on request."""
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--dump-line=no",
        f"--callgrind-out-file={out_dir}/cg.%p",
        *python_args,
    ]


def environment(library: Path, out_dir: Path) -> dict[str, str]:
    """The child's environment: one intra-op thread (no spinning pool threads) and fixed hashing."""
    return {
        **os.environ,
        LIBRARY_ENV: str(library),
        OUT_ENV: str(out_dir),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }


class InstructionMeter:
    """Counts the guest instructions between consecutive :meth:`mark` calls.

    ``start()`` switches instrumentation on (callgrind flushes its code cache, so call it once
    per stretch, not per step); each ``mark()`` has callgrind dump and zero its counter;
    ``stop()`` ends the stretch, and ``collect()`` then reads the dumps: the instructions from
    ``start()`` to the first ``mark()``, from there to the next, and so on. The dumps are read
    only after ``stop()``, so that parsing them is not counted.
    """

    def __init__(self) -> None:
        self._lib = ctypes.CDLL(os.environ[LIBRARY_ENV])
        self._out = Path(os.environ[OUT_ENV])
        if not self._lib.meter_on_valgrind():
            raise RuntimeError("InstructionMeter needs the process to run under valgrind --tool=callgrind")

    def start(self) -> None:
        self._lib.meter_start()

    def mark(self, label: str = "mark") -> None:
        self._lib.meter_dump(label.encode())

    def stop(self) -> None:
        self._lib.meter_stop()

    def collect(self) -> list[int]:
        # callgrind numbers its dumps per process: cg.<pid>.1, cg.<pid>.2, ...
        dumps = sorted(self._out.glob(f"cg.{os.getpid()}.*"), key=lambda path: int(path.suffix[1:]))
        totals = [read_total(dump.read_text()) for dump in dumps]
        for dump in dumps:
            dump.unlink()
        return totals


def start(python_args: list[str], out_dir: Path, library: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start ``python_args`` under callgrind (:func:`command`, :func:`environment`), its stderr to ``log``."""
    with log.open("w") as stderr:
        return subprocess.Popen(
            command(python_args, out_dir),
            env=environment(library, out_dir),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def read_total(dump: str) -> int:
    """The instruction total of one callgrind dump (its ``totals:`` line)."""
    for line in dump.splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise ValueError("not a callgrind dump: no 'totals:' line")

"""The core is pure torch: it imports, and its helpers work, where Lightning cannot be imported."""

import subprocess
import sys
import textwrap
from pathlib import Path

import lightning_hooks

PACKAGE = Path(lightning_hooks.__file__).parent
PURE_TORCH = ("core", "stats", "recorders", "diagnose")
"""The subpackages below the sinks and the callbacks, which import torch only."""

BLOCK = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("lightning", "lightning_fabric", "pytorch_lightning"):
            raise ImportError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())
"""


def run_without_lightning(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        timeout=120,
    )


def core_modules() -> list[str]:
    return sorted(
        ".".join(("lightning_hooks", *p.relative_to(PACKAGE).with_suffix("").parts))
        for folder in PURE_TORCH
        for p in (PACKAGE / folder).rglob("*.py")
        if p.stem != "__init__"
    )


def test_the_pure_torch_helpers_work_without_lightning() -> None:
    done = run_without_lightning(
        """
        import torch
        from torch import nn
        from lightning_hooks import find_nonfinite, format_table, trace_shapes

        model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
        print(format_table(trace_shapes(model, torch.zeros(4, 3))))
        print(find_nonfinite(model, torch.full((4, 3), float("nan"))))
        print("lightning" in sys.modules)
        """
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["Layer", "Type", "Input", "Output", "Params"]
    assert any(line.startswith("forward: ") for line in lines)
    assert lines[-1] == "False"


def test_touching_a_callback_without_lightning_says_what_to_install() -> None:
    done = run_without_lightning(
        """
        import lightning_hooks
        try:
            lightning_hooks.GradStats
        except ImportError as error:
            print(error)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "`lightning_hooks.GradStats` is a Lightning callback" in done.stdout
    assert "pip install lightning" in done.stdout


def test_no_core_module_imports_lightning() -> None:
    modules = core_modules()
    assert "lightning_hooks.stats.batch" in modules
    assert "lightning_hooks.recorders.finite" in modules
    assert "lightning_hooks.diagnose.checks.units" in modules
    done = run_without_lightning(
        f"""
        import importlib
        for name in {modules!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "lightning_fabric")))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

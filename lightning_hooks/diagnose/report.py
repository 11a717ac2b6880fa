"""How health findings read: the warning, the ``health/findings`` table, the end-of-fit summary (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_hooks.diagnose.health import HealthFinding

__all__ = ["COLUMNS", "rows", "summary", "warning"]

COLUMNS = ("check", "layers", "since step", "last step", "value", "threshold", "message")
"""The columns of the ``health/findings`` table."""


def rows(findings: Sequence[HealthFinding]) -> list[list[str | int]]:
    """One row per finding under :data:`COLUMNS`."""
    return [
        [f.check, ", ".join(f.layers), f.step, f.last_step, f"{f.value:.4g}", f"{f.threshold:.4g}", f.message]
        for f in findings
    ]


def warning(finding: HealthFinding) -> str:
    """The one warning a new finding gets.

    Example::

        >>> print(warning(HealthFinding("dead_units", ("fc.1",), 10, 30, 0.75, 0.7, "Most are dead.")))
        `HealthMonitor` found dead_units in `fc.1` since step 10 (value 0.75, threshold 0.7): Most are dead.
    """
    where = ", ".join(f"`{layer}`" for layer in finding.layers)
    return (
        f"`HealthMonitor` found {finding.check} in {where} since step {finding.step} "
        f"(value {finding.value:.4g}, threshold {finding.threshold:.4g}): {finding.message}"
    )


def summary(findings: Sequence[HealthFinding], steps: int) -> str:
    """What the end of a fit prints: ``no problems found in 400 steps``, or one line per finding.

    Example::

        >>> summary([], 400)
        'HealthMonitor: no problems found in 400 steps.'
    """
    if not findings:
        return f"HealthMonitor: no problems found in {steps} steps."
    lines = [f"HealthMonitor: {len(findings)} problem(s) found in {steps} steps:"]
    for f in findings:
        span = f"step {f.step}" if f.last_step == f.step else f"steps {f.step}-{f.last_step}"
        lines.append(f"  {f.check} in {', '.join(f.layers)} ({span}): {f.message}")
    return "\n".join(lines)

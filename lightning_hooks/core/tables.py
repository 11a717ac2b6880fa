"""A table as data (columns, rows, a caption) and its markdown, for every logger that shows text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Cell", "Table", "markdown_table"]

Cell = str | int | float


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Cell]]) -> str:
    """A markdown table (TensorBoard's text dashboard and MLflow's artifact viewer render it).

    Example::

        >>> print(markdown_table(["Layer", "Params"], [["fc1", 40], ["a|b", 0]]))
        | Layer | Params |
        |---|---|
        | fc1 | 40 |
        | a\\|b | 0 |
    """

    def line(cells: Sequence[Cell]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(columns), "|" + "---|" * len(columns), *(line(r) for r in rows)])


@dataclass(frozen=True)
class Table:
    """Rows under named columns, e.g. one row per module call; ``caption`` says what they are of."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    caption: str = ""

    def markdown(self) -> str:
        """The caption in bold, then the table."""
        table = markdown_table(self.columns, self.rows)
        return f"**{self.caption}**\n\n{table}" if self.caption else table

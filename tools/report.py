"""What the tools print besides their results: the benches' Markdown tables, the error a bench
says in one line for a bad option, and the progress lines of the long-running commands
(``replay``, ``chaos``, ``ctl drain``)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence


class BenchUsageError(Exception):
    """A bad option or an environment that cannot run the benchmark: said in one line."""


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A Markdown table: ``header``, then one line per row. ``align`` has a letter per column,
    ``l`` (the default for a column it does not reach) or ``r`` (numbers)."""
    marks = ["---:" if align[i : i + 1] == "r" else "---" for i in range(len(header))]
    lines = [_row(header), _row(marks)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells in a table of {len(header)} columns")
        lines.append(_row([str(cell) for cell in row]))
    return "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def progress(line: str) -> None:
    """A progress line on stderr, at once (stdout keeps the result)."""
    print(line, file=sys.stderr, flush=True)

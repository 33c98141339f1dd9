"""Markdown tables: plain text that renders on GitHub and reads fine in a terminal."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["fmt", "markdown_table"]


def fmt(value: object, digits: int = 1) -> str:
    """Numbers rounded for reading; None and non-finite values shown as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 1) -> str:
    """A GitHub-flavoured markdown table; numeric columns are right-aligned."""
    cells = [[fmt(v, digits) for v in row] for row in rows]
    numeric = [
        all(isinstance(row[k], int | float) or row[k] is None for row in rows) and bool(rows)
        for k in range(len(header))
    ]
    widths = [max([len(h)] + [len(r[k]) for r in cells]) for k, h in enumerate(header)]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "| "
        + " | ".join(
            ("-" * (w - 1) + ":") if num else "-" * w
            for w, num in zip(widths, numeric, strict=True)
        )
        + " |"
    )
    return "\n".join([line(list(header)), rule, *(line(r) for r in cells)])

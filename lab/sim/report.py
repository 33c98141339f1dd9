"""Human output for simulator runs: a progress bar on a TTY and markdown tables."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO


def progress_bar(label: str, stream: TextIO | None = None) -> Callable[[float], None] | None:
    """A callback drawing ``label [#####.....] 42%`` on a TTY; None when not on a TTY."""
    out = stream if stream is not None else sys.stderr
    if not out.isatty():
        return None
    start = time.perf_counter()
    width = 30

    def update(fraction: float) -> None:
        done = int(width * min(1.0, fraction))
        elapsed = time.perf_counter() - start
        out.write(f"\r{label} [{'#' * done}{'.' * (width - done)}] {fraction:4.0%} {elapsed:5.1f}s")
        if fraction >= 1.0:
            out.write("\n")
        out.flush()

    return update


COLUMNS = (
    ("policy", "policy"),
    ("GPU-s", "cost_gpu_seconds"),
    ("$", "cost_usd"),
    # How late a chunk reached its viewer past its due time, 0 when on time (most chunks are:
    # a p50 of 0 is the normal case, not a missing figure).
    ("late p50 ms", ("latency_ms", "p50")),
    ("late p99 ms", ("latency_ms", "p99")),
    ("late max ms", ("latency_ms", "max")),
    ("deadline %", "deadline_attainment"),
    ("stall-adj. %", "stall_adjusted_attainment"),
    ("migr.", "migrations"),
    ("scale ev.", "scale_events"),
    ("peak GPUs", "peak_gpus"),
    ("decision p99 ms", ("decision_ms", "p99")),
    ("chunks", "chunks"),
)


def _cell(row: dict[str, Any], key: str | tuple[str, str]) -> str:
    value = row.get(key[0], {}).get(key[1]) if isinstance(key, tuple) else row.get(key)
    if value is None:
        return "-"  # a document from before the column existed
    if key in ("deadline_attainment", "stall_adjusted_attainment"):
        return f"{100 * value:.2f}"
    if key == "cost_usd":
        return f"{value:.2f}"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 1 else f"{value:.0f}"
    return str(value)


def quality_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """How the chunks went under the quality budget, when any row ran chunks at fewer steps
    (none otherwise): a line for each such row (on time at full steps, on time at fewer, late;
    the share at fewer steps), then one naming the rows whose every chunk ran full steps."""
    reduced = [row for row in rows if row.get("on_time_reduced") or row.get("reduced_pct")]
    if not reduced:
        return []
    out = [
        f"quality budget, {row['policy']}: {row['on_time_full']} chunks on time at full steps, "
        f"{row['on_time_reduced']} on time at fewer, {row['late']} late; "
        f"{row['reduced_pct']:.2f}% at fewer steps"
        for row in reduced
    ]
    full = [row["policy"] for row in rows if row not in reduced and "reduced_pct" in row]
    if full:
        out.append(f"quality budget: every chunk of {', '.join(full)} ran full steps")
    return out


def results_table(rows: Sequence[dict[str, Any]], extra: Sequence[str] = ()) -> str:
    """Rows are ``SimResult.to_json()`` documents; ``extra`` adds columns from ``params``."""
    heads = [h for h, _ in COLUMNS] + list(extra)
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        cells = [_cell(row, key) for _, key in COLUMNS]
        cells += [str(row.get("params", {}).get(name, "")) for name in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

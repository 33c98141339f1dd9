"""Human output: the progress bar only on a TTY, and the markdown table."""

from __future__ import annotations

import io

from lab.sim.report import progress_bar, results_table


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_tty():
    assert progress_bar("x", io.StringIO()) is None
    out = _Tty()
    update = progress_bar("run", out)
    update(0.5)
    update(1.0)
    text = out.getvalue()
    assert "run [" + "#" * 15 + "." * 15 + "]  50%" in text
    assert text.endswith("\n") and "#" * 30 in text


def test_results_table_rows():
    row = {
        "policy": "p",
        "cost_gpu_seconds": 1234.4,
        "cost_usd": 0.6858,
        "latency_ms": {"p50": 917.0, "p99": 1873.1, "max": 15553.0},
        "deadline_attainment": 0.95281,
        "stall_adjusted_attainment": 0.9012,
        "migrations": 3,
        "scale_events": 2,
        "peak_gpus": 4,
        "decision_ms": {"p50": 0.01, "p99": 0.027, "max": 0.2},
        "chunks": 10,
        "params": {"gpus": 7},
    }
    lines = results_table([row], extra=["gpus"]).splitlines()
    assert lines[0].startswith("| policy | GPU-s | $ |") and lines[0].endswith("| gpus |")
    assert "| deadline % | stall-adj. % |" in lines[0]
    assert lines[2] == (
        "| p | 1234 | 0.69 | 917 | 1873 | 15553 | 95.28 | 90.12 | 3 | 2 | 4 | 0.027 | 10 | 7 |"
    )
    # A document written before the stall-adjusted column existed shows a dash there.
    del row["stall_adjusted_attainment"]
    assert "| 95.28 | - | 3 |" in results_table([row]).splitlines()[2]

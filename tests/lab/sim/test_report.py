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


def test_sim_run_prints_the_report_its_function_returns(tmp_path, capsys):
    """`sim run` prints what ``sim_run`` returns (``sim tables`` calls the function, never
    the command): the same lines, the wall times (and the decision times) apart."""
    from lab.sim.run import RunRequest, sim_run
    from tools.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("t,session_id,event\n0,a,arrive\n2,b,arrive\n5,a,depart\n9,b,depart\n")
    argv = ["--trace", str(trace), "--policy", "turboserve,least_loaded", "--gpus", "1"]
    assert main(["sim", "run", *argv]) == 0
    printed = capsys.readouterr().out.splitlines()
    request = RunRequest(trace=str(trace), policy="turboserve,least_loaded", gpus=1)
    report = sim_run(request)
    assert [r["policy"] for r in report.rows] == ["turboserve", "least_loaded"]
    assert report.sweep_lines() == []  # not swept: the default with named policies
    lines = "\n".join(report.lines(wall=False)).splitlines()
    column = lines[1].split(" | ").index("decision p99 ms")

    def timeless(line: str) -> str:
        cells = line.split(" | ")
        return " | ".join(cells[:column] + cells[column + 1 :]) if line.startswith("|") else line

    assert [timeless(line) for line in printed if not line.startswith("simulated ")] == [
        timeless(line) for line in lines
    ]
    assert printed[-1].startswith("simulated 2 run(s) in ")

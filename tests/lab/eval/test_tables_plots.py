"""Markdown tables and PNG plots."""

from __future__ import annotations

from PIL import Image

from lab.eval.matched import CurvePoint
from lab.eval.plots import plot_cost_latency, plot_gpus_over_time, plot_latency_cdf
from lab.eval.tables import fmt, markdown_table


def test_markdown_table_aligns_numbers_right_and_text_left():
    table = markdown_table(["policy", "cost"], [["turboserve", 1.25], ["rr", 10.0]], digits=2)
    lines = table.splitlines()
    assert lines[0] == "| policy     |  cost |"
    assert lines[1] == "| ---------- | ----: |"
    assert lines[2] == "| turboserve |  1.25 |"
    assert lines[3] == "| rr         | 10.00 |"


def test_fmt_shows_missing_and_infinite_values_as_dashes():
    assert fmt(None) == "-"
    assert fmt(float("inf")) == "-"
    assert fmt(True) == "yes"
    assert fmt(12345) == "12,345"


def _is_png(path, min_size=(300, 200)):
    with Image.open(path) as img:
        return img.format == "PNG" and img.size[0] >= min_size[0] and img.size[1] >= min_size[1]


def test_plots_write_pngs(tmp_path):
    curves = {"a": [CurvePoint(1, 900), CurvePoint(2, 500)], "b": [CurvePoint(1.5, 700)]}
    p1 = plot_cost_latency(
        curves,
        tmp_path / "c.png",
        title="t",
        highlight={"ours": CurvePoint(1.2, 400)},
        floor_cost=0.8,
    )
    p2 = plot_gpus_over_time(
        {"a": ([0, 10, 20], [1, 3, 2])}, ([0, 10, 20], [1, 2, 2]), tmp_path / "g.png", title="t"
    )
    p3 = plot_latency_cdf({"a": [900, 950, 1200]}, tmp_path / "l.png", title="t", deadline_ms=1000)
    assert all(_is_png(p) for p in (p1, p2, p3))


def test_a_run_carries_the_simulators_stall_adjusted_attainment():
    """The evaluation takes the measure of service from the simulator's ledger, where a
    session that waits 10 s for a GPU misses every period past the startup allowance."""
    from lab.eval.runs import RunSpec, execute, prime_trace_cache
    from lab.sim.traceio import make_trace

    trace = make_trace("wait10", [(0.0, "a", "arrive"), (10.0, "a", "depart")])
    prime_trace_cache({"wait10": trace})
    run = execute(RunSpec("wait10", "least_loaded", "least_loaded", (("gpus", 0),)))
    # No GPU: no chunk, ceil((10,000 - 1,250) / 1,250) = 7 missed periods.
    assert run.chunks == 0 and run.missed_periods == 7
    assert run.stall_adjusted_attainment == 0.0
    assert run.to_json()["stall_adjusted_attainment"] == 0.0

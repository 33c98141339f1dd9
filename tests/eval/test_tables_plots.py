"""Markdown tables and PNG plots."""

from __future__ import annotations

from PIL import Image

from services.scheduler.eval.matched import CurvePoint
from services.scheduler.eval.plots import plot_cost_latency, plot_gpus_over_time, plot_latency_cdf
from services.scheduler.eval.tables import fmt, markdown_table


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
    p1 = plot_cost_latency(curves, tmp_path / "c.png", title="t",
                           highlight={"ours": CurvePoint(1.2, 400)}, floor_cost=0.8)
    p2 = plot_gpus_over_time({"a": ([0, 10, 20], [1, 3, 2])}, ([0, 10, 20], [1, 2, 2]),
                             tmp_path / "g.png", title="t")
    p3 = plot_latency_cdf({"a": [900, 950, 1200]}, tmp_path / "l.png", title="t",
                          deadline_ms=1000)
    assert all(_is_png(p) for p in (p1, p2, p3))


def test_stall_adjusted_attainment_counts_each_waiting_deadline_as_a_miss():
    from services.scheduler.eval.runs import RunSpec, RunSummary

    run = RunSummary(
        spec=RunSpec("t", "p", "p"), cost_gpu_h=1.0, cost_usd=2.0, p50_ms=1, p99_ms=1,
        max_ms=1, attainment=0.9, migrations=0, scale_events=0, peak_gpus=1,
        decision_p99_ms=0.0, served_floor_gpu_h=0.5, unserved_session_s=125.0, wall_s=0.0,
        chunks=900, deadline_ms=1250.0,
    )
    # 810 chunks on time out of 900 delivered + 100 deadline periods spent waiting.
    assert run.stall_adjusted_attainment == 810 / 1000

"""The lower-bound verdict says on how many runs the trace floor was actually checked."""

from __future__ import annotations

from types import SimpleNamespace

from lab.eval.analysis import _lower_bound
from lab.eval.report import _bound_text
from lab.eval.runs import RunSpec, RunSummary


def _run(cost_h: float, unserved_s: float) -> RunSummary:
    return RunSummary(
        spec=RunSpec("t", "least_loaded", "least_loaded", (("gpus", 1),)),
        cost_gpu_h=cost_h,
        cost_usd=2 * cost_h,
        p50_ms=1,
        p99_ms=1,
        max_ms=1,
        attainment=1.0,
        migrations=0,
        scale_events=0,
        peak_gpus=1,
        decision_p99_ms=0.0,
        served_floor_gpu_h=0.1,
        unserved_session_s=unserved_s,
        wall_s=0.0,
        chunks=10,
        deadline_ms=1250.0,
    )


def test_runs_that_left_sessions_waiting_are_counted_as_not_checked_against_the_floor():
    floors = SimpleNamespace(floor_h=1.0, with_boot_h={})
    bound = _lower_bound([_run(1.5, 0.0), _run(0.5, 300.0), _run(2.0, 0.0)], floors)
    assert bound["holds"] is True
    assert bound["runs"] == 3
    assert bound["runs_checked_against_floor"] == 2
    assert bound["runs_excluded_from_floor_check"] == 1


def test_report_names_the_excluded_runs_next_to_the_verdict():
    summary = {
        "oracle_is_lower_bound": True,
        "lower_bound_runs": {
            "runs": 660,
            "checked_against_floor": 640,
            "excluded_from_floor_check": 20,
        },
    }
    text = _bound_text(summary)
    assert text.startswith("yes")
    assert "660 of 660" in text and "floor on 640" in text and "20 runs" in text

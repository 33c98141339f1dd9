"""The quality budget in the evaluation: the budget policy's cost at 99% of chunk periods on
time, on the runs with at most 1% / 5% of chunks at fewer steps, against the costs the
evaluation reads for turboserve and the rivals."""

from __future__ import annotations

import dataclasses

import pytest

from lab.eval.quality import quality_budget, quality_summary, quality_table
from lab.eval.runs import RunSummary
from tests.lab.eval.test_not_reached import document  # noqa: F401  (the fixture)
from tests.lab.eval.test_service_level import _run as _service_run


def _run(curve: str, cost: float, stall: float, reduced: float = 0.0, **params) -> RunSummary:
    return dataclasses.replace(_service_run(curve, cost, stall, **params), reduced_pct=reduced)


def _runs() -> list[RunSummary]:
    return [
        *(_run("least_loaded", g / 2, a, gpus=g) for g, a in ((8, 0.985), (10, 0.995))),
        *(_run("round_robin", g / 2, a, gpus=g) for g, a in ((8, 0.98), (12, 0.999))),
        *(_run("memory_aware", g / 2, 0.9, gpus=g) for g in (8, 12)),
        _run("turboserve", 3.0, 0.97, rho_hat=0.9),
        _run("turboserve", 4.0, 0.995, rho_hat=0.5),
        _run("hpa", 4.5, 0.999, target=0.5),
        # The budget: more headroom, fewer chunks at fewer steps. The cheapest point that
        # serves 99% has 8% of its chunks reduced; at most 5%: 3.5 GPU-h; at most 1%: 4.0.
        _run("turboserve_q", 3.0, 0.992, 8.0, rho_hat=0.9),
        _run("turboserve_q", 3.5, 0.995, 4.0, rho_hat=0.7),
        _run("turboserve_q", 4.0, 0.999, 0.5, rho_hat=0.5),
        _run("turboserve_q", 3.2, 0.993, 6.0),  # the adaptive point
    ]


def test_the_limit_on_reduced_chunks_moves_the_reading_to_dearer_points():
    q = quality_budget(_runs())
    assert q is not None and q["policy"] == "turboserve_q" and q["min_steps"] == 3
    assert q["any_reduced"]["cost_gpu_hours"] == pytest.approx(3.0)
    assert q["any_reduced"]["reduced_pct"] == 8.0 and q["any_reduced"]["upper_bound"]
    assert q["max_reduced_5pct"]["cost_gpu_hours"] == pytest.approx(3.5)
    assert q["max_reduced_5pct"]["reduced_pct"] == 4.0 and q["max_reduced_5pct"]["runs"] == 2
    assert q["max_reduced_1pct"]["cost_gpu_hours"] == pytest.approx(4.0)
    assert q["reduced_pct_adaptive"] == 6.0
    # Against turboserve without the budget (4.0 GPU-h read at 99% between 3.0 and 4.0 on its
    # curve: 0.97 -> 0.995, so 99% at 3.8), the cheapest static pool (least_loaded x 10, 5.0)
    # and HPA (its only point serving 99%, 4.5, an upper bound).
    assert q["turboserve"]["cost_gpu_hours"] == pytest.approx(3.8)
    assert q["best_static"] == "least_loaded"
    v5 = q["max_reduced_5pct"]["versus"]
    assert v5["turboserve"] == {
        "pct": pytest.approx(100 * (3.5 / 3.8 - 1), abs=1e-3),
        "reached": True,
    }
    assert v5["best_static"] == {"pct": -30.0, "reached": True}
    assert v5["hpa"]["pct"] == pytest.approx(100 * (3.5 / 4.5 - 1), abs=1e-3)
    assert q["max_reduced_1pct"]["versus"]["turboserve"]["pct"] == pytest.approx(
        100 * (4.0 / 3.8 - 1), abs=1e-3
    )
    # Its only run within 1% already serves more than 99%: the comparison is a bound.
    assert q["max_reduced_1pct"]["upper_bound"]
    assert "| +5.3 (at most) " in quality_table({"traces": {"t": {"quality_budget": q}}})


def test_a_limit_no_run_meets_is_not_reached_and_left_out_of_the_averages():
    runs = [r for r in _runs() if r.spec.curve != "turboserve_q" or r.reduced_pct > 1.0]
    q = quality_budget(runs)
    assert q is not None
    assert q["max_reduced_1pct"] == {
        "cost_gpu_hours": None,
        "reached": False,
        "runs": 0,
        "versus": {
            "turboserve": {"pct": None, "reached": False},
            "best_static": {"pct": None, "reached": False},
            "hpa": {"pct": None, "reached": False},
        },
    }
    summary = quality_summary({"a": {"quality_budget": q}, "b": {"quality_budget": None}})
    assert summary is not None and summary["traces"] == 1
    block = summary["max_reduced_1pct"]["vs_turboserve_pct"]
    assert block["avg"] is None and block["left_out"] == ["a"]
    five = summary["max_reduced_5pct"]["vs_best_static_pct"]
    assert five["avg"] == -30.0 and five["traces"] == 1 and five["left_out"] == []
    table = quality_table({"traces": {"a": {"quality_budget": q}}})
    assert "| a " in table and "not reached" in table


def test_no_budget_curve_no_figures():
    assert quality_budget([r for r in _runs() if r.spec.curve != "turboserve_q"]) is None
    assert quality_summary({"a": {}}) is None


def test_sim_tables_writes_only_the_quality_budget_section(tmp_path, capsys):
    import json

    from tools.cli import main

    q = quality_budget(_runs())
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"summary": {}, "traces": {"calm": {"quality_budget": q}}}))
    target = tmp_path / "results.md"
    keep = "<!-- sim tables: service_level -->\nold\n<!-- /sim tables: service_level -->\n"
    target.write_text(
        keep + "<!-- sim tables: quality_budget -->\nold\n<!-- /sim tables: quality_budget -->\n"
    )
    args = ["sim", "tables", "--eval", str(path), "--only", "quality_budget"]
    assert main([*args, "--write", str(target)]) == 0
    written = target.read_text()
    assert (
        written.startswith(keep) and "| calm " in written and "\nold\n" not in written[len(keep) :]
    )
    assert main(["sim", "tables", "--eval", str(path), "--only", "nope"]) == 2
    assert "--only takes sections of" in capsys.readouterr().err


def test_a_report_without_the_placement_gap_says_it_was_not_measured(
    document: dict,  # noqa: F811
) -> None:
    # sim evaluate --placement-instances 0 measures no placement gap: the report says so
    # instead of failing (and losing the figures it would have written).
    from lab.eval.report import markdown_report

    summary = {
        **document["summary"],
        "placement_gap_to_oracle_pct": {"avg": None, "max": None, "instances": 0},
    }
    text = markdown_report({**document, "summary": summary})
    assert "not measured (--placement-instances 0)" in text

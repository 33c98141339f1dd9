"""A service level that no run of a sweep reached reads "not reached", never as a cost.

Two traces of made-up runs. On ``aside`` (the shape of a bursty trace kept aside, K = 2) no
autoscaler's sweep serves 99% of chunk periods: turboserve's adaptive point serves 97.9% for
47.4 GPU-h and its dearest point, its best, 98.4% for 140.7 GPU-h, while a 46-GPU static pool
serves 99.2% for 47.6 GPU-h. Read as a cost, the dearest point would make turboserve +195.6%
against the static pool. On ``plain`` every policy reaches the level.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from lab.eval import results
from lab.eval.analysis import analyse_trace, summarise
from lab.eval.matched import reduction_pct
from lab.eval.report import markdown_report
from lab.eval.runs import RunSpec, RunSummary
from lab.eval.service_level import curve_at_slo, static_at_slo
from tools.cli import main

PROFILE = "h200-wan-1.3b-measured"
AUTOSCALERS = (
    "turboserve",
    "no_migration",
    "clairvoyant",
    "turboserve_predictive",
    "least_loaded_autoscale",
    "hpa",
)
NOT_REACHED = "not reached (best 98.4% at 140.7 GPU-h)"
MISREAD = round(-reduction_pct(47.6, 140.7), 1)  # what reading the dearest point gave: 195.6


def _run(trace: str, curve: str, cost: float, stall: float, **params) -> RunSummary:
    policy = curve
    return RunSummary(
        spec=RunSpec(trace, policy, curve, tuple(params.items()), profile=PROFILE),
        cost_gpu_h=cost,
        cost_usd=0.0,
        p50_ms=0.0,
        p99_ms=3000.0 - 20.0 * cost,
        max_ms=3000.0,
        attainment=stall,
        migrations=0,
        scale_events=0,
        peak_gpus=1,
        decision_p99_ms=0.0,
        served_floor_gpu_h=0.0,
        unserved_session_s=0.0,
        wall_s=0.0,
        stall_adjusted_attainment=stall,
    )


def _static(trace: str, per_gpu_h: float, attain: dict[int, float]) -> list[RunSummary]:
    runs = []
    for curve in ("round_robin", "least_loaded", "memory_aware", "no_autoscale"):
        for gpus, stall in attain.items():
            stall = min(stall, 0.95) if curve == "memory_aware" else stall
            runs.append(_run(trace, curve, gpus * per_gpu_h, stall, gpus=gpus))
    return runs


def _aside() -> list[RunSummary]:
    """No autoscaler reaches 99%; static pools do from 46 GPUs."""
    runs = _static("aside", 47.6 / 46, {40: 0.95, 44: 0.985, 46: 0.992, 50: 0.999})
    for curve in AUTOSCALERS:
        knob = "target" if curve == "hpa" else "rho_hat"
        runs += [
            _run("aside", curve, 47.4, 0.979),  # the adaptive point
            _run("aside", curve, 30.0, 0.93, **{knob: 0.95}),
            _run("aside", curve, 140.7, 0.984, **{knob: 0.35}),
        ]
    return runs


def _plain() -> list[RunSummary]:
    """Every policy reaches 99%: turboserve at 20 GPU-h, the best static pool at 25."""
    runs = _static("plain", 0.5, {40: 0.97, 50: 0.995, 60: 0.999})
    for curve in AUTOSCALERS:
        knob = "target" if curve == "hpa" else "rho_hat"
        extra = 0.0 if curve == "turboserve" else 4.0
        runs += [
            _run("plain", curve, 18.0 + extra, 0.98, **{knob: 0.95}),
            _run("plain", curve, 19.0 + extra, 0.985),
            _run("plain", curve, 22.0 + extra, 1.0, **{knob: 0.55}),
        ]
    return runs


def _floors() -> Any:  # stands in for TraceFloors: only the fields analyse_trace reads
    return SimpleNamespace(
        capacity=2,
        floor_h=10.0,
        with_boot_h={30.0: 12.0},
        with_boot_below_k_h={30.0: 14.0},
        peak_active=90,
        steps=[],
    )


@pytest.fixture(scope="module")
def document() -> dict:
    traces = {
        name: analyse_trace(name, runs, _floors(), 30.0)
        for name, runs in (("aside", _aside()), ("plain", _plain()))
    }
    summary = summarise(traces, {"avg": 0.0, "max": 0.0, "instances": 10})
    config = {
        "quick": False,
        "profile": PROFILE,
        "capacity": 2,
        "boot_delay_s": 30.0,
        "runs": 2,
        "wall_s": 0.0,
        "rho_table_sha256": None,
    }
    return {
        "summary": summary,
        "traces": traces,
        "placement": {},
        "config": config,
        "by_profile": {PROFILE: {"summary": summary, "traces": traces, "config": config}},
    }


def test_an_unreached_level_keeps_its_number_beside_reached_false(document):
    v = document["traces"]["aside"]["service_level"]
    ours = v["turboserve"]
    assert ours["reached"] is False
    assert ours["cost_gpu_hours"] == pytest.approx(140.7)  # a lower bound, kept for the record
    assert (ours["best_attainment"], ours["best_cost_gpu_hours"]) == (0.984, 140.7)
    assert (ours["adaptive_attainment"], ours["adaptive_cost_gpu_hours"]) == (0.979, 47.4)
    assert v["static"]["least_loaded"]["gpus"] == 46 and v["static"]["least_loaded"]["reached"]
    assert v["cost_reduction_vs_best_baseline_reached"] is False
    assert v["cost_vs_best_of_least_loaded_and_hpa_reached"] is False
    assert set(v["not_reached"]) == {*AUTOSCALERS, "memory_aware"}
    assert document["traces"]["plain"]["service_level"]["not_reached"] == ["memory_aware"]


def test_no_average_or_maximum_includes_the_unreached_trace(document):
    plain = document["traces"]["plain"]["service_level"]
    slo = document["summary"]["cost_reduction_at_matched_slo_pct"]
    assert slo["avg_vs_best_baseline"] == plain["cost_reduction_vs_best_baseline_pct"]
    assert slo["worst_vs_best_baseline"] == plain["cost_reduction_vs_best_baseline_pct"]
    assert slo["per_trace"] == {
        "aside": None,
        "plain": plain["cost_reduction_vs_best_baseline_pct"],
    }
    assert slo["traces_averaged"] == 1 and slo["left_out"] == {"aside": ["turboserve"]}
    robust = document["summary"]["robustness"]
    assert robust["max_cost_above_best_of_least_loaded_and_hpa_pct"] == pytest.approx(
        plain["cost_vs_best_of_least_loaded_and_hpa_pct"]
    )
    assert robust["per_trace"]["aside"] is None and robust["traces_compared"] == 1
    # A static least-loaded pool serves 99% on "aside" and turboserve does not: the bar fails.
    assert robust["turboserve_not_reached_where_a_rival_reaches"] == ["aside"]
    assert robust["met"] is False


def test_the_report_says_not_reached(document):
    text = markdown_report(document)
    assert NOT_REACHED in text
    assert "left out: aside (turboserve not reached)" in text
    assert "not reached (turboserve)" in text
    assert f"{MISREAD}" not in text and f"{-MISREAD}" not in text


def test_sim_tables_says_not_reached(document, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(results, "_policy_all", lambda: "(sim run table)")
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(document))
    capsys.readouterr()
    assert main(["sim", "tables", "--eval", str(path), "--no-bench"]) == 0
    out = capsys.readouterr().out
    aside = next(line for line in out.splitlines() if line.startswith("| aside"))
    assert NOT_REACHED in aside and "not reached (turboserve)" in aside
    assert "over 1 of 2 traces; left out: aside (turboserve not reached)" in out
    assert "turboserve alone misses 99% on aside" in out
    assert f"{MISREAD}" not in out


def test_a_document_written_before_the_flags_is_read_the_same_way(
    document, tmp_path, capsys, monkeypatch
):
    """An older evaluation JSON, whose summary averaged every trace, is re-read from its
    traces: the tables never print the dearest point as a cost."""
    monkeypatch.setattr(results, "_policy_all", lambda: "(sim run table)")
    old = json.loads(json.dumps(document))
    for doc in (old, old["by_profile"][PROFILE]):
        for t in doc["traces"].values():
            v = t["service_level"]
            for key in (
                "cost_reduction_vs_best_baseline_reached",
                "cost_vs_best_of_least_loaded_and_hpa_reached",
                "not_reached",
            ):
                v.pop(key)
        for block in ("cost_reduction_at_matched_slo_pct", "robustness"):
            doc["summary"][block] = {
                k: v
                for k, v in doc["summary"][block].items()
                if k in ("avg_vs_best_baseline", "per_trace", "bar_pct", "slo_attainment", "met")
            }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    capsys.readouterr()
    assert main(["sim", "tables", "--eval", str(path), "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "left out: aside (turboserve not reached)" in out and f"{MISREAD}" not in out


def test_a_sweep_above_the_level_everywhere_reaches_it_at_most_at_its_cheapest_point():
    runs = [_run("t", "hpa", 10.0, 0.995, target=0.9), _run("t", "hpa", 12.0, 1.0, target=0.5)]
    assert curve_at_slo(runs) == {"cost_gpu_hours": 10.0, "reached": True, "upper_bound": True}
    missed = [
        _run("t", "least_loaded", 5.0, 0.9, gpus=10),
        _run("t", "least_loaded", 6.0, 0.97, gpus=12),
    ]
    assert static_at_slo(missed) == {
        "cost_gpu_hours": 6.0,
        "gpus": 12,
        "attainment": 0.97,
        "reached": False,
        "best_attainment": 0.97,
        "best_cost_gpu_hours": 6.0,
    }


def test_the_gap_to_the_clairvoyant_leaves_out_traces_where_its_sweep_misses_our_p99():
    from lab.eval.analysis import _oracle_gap

    def trace(gap: float, inside: bool) -> dict:
        return {
            "oracle": {
                "gap_to_clairvoyant_matched_latency_pct": gap,
                "clairvoyant_match_in_range": inside,
            }
        }

    gap = _oracle_gap({"a": trace(10.0, True), "b": trace(300.0, False), "c": trace(20.0, True)})
    assert gap == {"avg": 15.0, "max": 20.0, "traces_averaged": 2, "left_out": ["b"]}
    assert _oracle_gap({"b": trace(300.0, False)})["avg"] is None


def test_a_gap_to_the_clairvoyant_outside_its_sweep_is_printed_as_such():
    from lab.eval.report import _by_boot_table

    by_boot = {
        "30": {
            "latency_reduction_vs_best_baseline_pct": 1.0,
            "cost_reduction_vs_best_baseline_pct": 1.0,
            "gap_to_clairvoyant_same_rho_pct": 1.0,
            "gap_to_floor_with_boot_pct": 1.0,
            "gap_to_clairvoyant_matched_latency_pct": 5.0,
            "gap_to_clairvoyant_matched_latency_traces": 2,
        },
        "120": {
            "latency_reduction_vs_best_baseline_pct": 1.0,
            "cost_reduction_vs_best_baseline_pct": 1.0,
            "gap_to_clairvoyant_same_rho_pct": 1.0,
            "gap_to_floor_with_boot_pct": 1.0,
            "gap_to_clairvoyant_matched_latency_pct": None,
            "gap_to_clairvoyant_matched_latency_traces": 0,
        },
    }
    rows = _by_boot_table(by_boot, total=7).splitlines()
    assert "5.0 (2 of 7 traces)" in rows[2]
    assert "not reached on any of 7 traces (our p99 outside its sweep)" in rows[3]

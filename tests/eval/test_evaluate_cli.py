"""`turboserve sim evaluate` end to end on a folder of two short traces."""

from __future__ import annotations

import json

import pytest

from services.cli import main
from services.scheduler.sim.synth import generate, spec
from services.scheduler.sim.traceio import write_trace

SUMMARY_KEYS = {
    "cost_reduction_at_matched_latency_pct": {"avg_vs_best_baseline", "max_vs_best_baseline"},
    "latency_reduction_at_matched_cost_pct": {"avg_vs_best_baseline", "max_vs_best_baseline"},
    "ablation_cost_increase_pct": {"no_migration", "no_autoscale"},
    "autoscaler_gap_to_oracle_pct": {"avg", "max"},
    "autoscaler_gap_to_floor_pct": {"avg", "max"},
    "placement_gap_to_oracle_pct": {"avg", "max"},
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    traces = root / "traces"
    traces.mkdir()
    for name in ("bursty", "calm"):
        write_trace(generate(spec(name, seed=7, duration_s=240.0), name=f"short_{name}"),
                    traces / f"short_{name}.csv.gz")
    (traces / "notes.txt").write_text("not a trace")
    out = root / "out.json"
    plots = root / "plots"
    code = main(["sim", "evaluate", "--traces", str(traces), "--quick", "--jobs", "1",
                 "--placement-instances", "40", "--json", str(out), "--plots", str(plots)])
    return code, json.loads(out.read_text()), plots


def test_the_json_has_the_keys_of_the_issue(result):
    code, doc, _ = result
    assert code == 0
    summary = doc["summary"]
    for key, inner in SUMMARY_KEYS.items():
        assert inner <= set(summary[key]), key
        assert all(isinstance(summary[key][k], float | int) for k in inner)
    assert summary["oracle_is_lower_bound"] is True
    assert set(doc["traces"]) == {"short_bursty", "short_calm"}
    assert doc["placement"]["instances"] == 40


def test_per_trace_figures_are_consistent(result):
    _, doc, _ = result
    for t in doc["traces"].values():
        ours = t["turboserve"]["cost_gpu_hours"]
        # The floor bounds our cost; the gap is reported against it.
        assert t["oracle"]["floor_gpu_hours"] <= ours
        assert t["oracle"]["floor_gpu_hours"] <= t["oracle"]["floor_with_boot_gpu_hours"]
        expected = 100 * (ours / t["oracle"]["floor_gpu_hours"] - 1)
        assert t["oracle"]["gap_to_floor_pct"] == pytest.approx(expected, abs=0.05)
        for name in ("round_robin", "least_loaded", "memory_aware", "hpa"):
            assert name in t["vs"]


def test_plots_are_written(result):
    _, _, plots = result
    names = {p.name for p in plots.iterdir()}
    assert {"cost_latency_short_bursty.png", "cost_latency_short_calm.png"} <= names
    assert any(n.startswith("gpus_over_time_") for n in names)
    assert any(n.startswith("latency_cdf_") for n in names)


def test_an_empty_folder_is_an_error(tmp_path, capsys):
    assert main(["sim", "evaluate", "--traces", str(tmp_path)]) == 2
    assert "no .csv" in capsys.readouterr().err

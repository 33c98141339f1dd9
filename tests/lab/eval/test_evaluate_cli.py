"""`turboserve sim evaluate` end to end on a folder of two short traces."""

from __future__ import annotations

import json

import pytest

from lab.sim.synth import generate, spec
from lab.sim.traceio import write_trace
from tools.cli import main

SUMMARY_KEYS = {
    "cost_reduction_at_matched_latency_pct": {"avg_vs_best_baseline", "max_vs_best_baseline"},
    "latency_reduction_at_matched_cost_pct": {"avg_vs_best_baseline", "max_vs_best_baseline"},
    "ablation_cost_increase_pct": {"no_migration", "no_autoscale"},
    "autoscaler_gap_to_oracle_pct": {"avg", "max"},
    "autoscaler_gap_to_floor_pct": {"avg", "max"},
    "placement_gap_to_oracle_pct": {"avg", "max"},
    "gap_to_boot_aware_floor_pct": {"avg"},
    "cost_reduction_at_matched_slo_pct": {"avg_vs_best_baseline", "slo_attainment"},
    "robustness": {"max_cost_above_best_of_least_loaded_and_hpa_pct", "bar_pct"},
    "gap_to_clairvoyant_at_slo_pct": {"slo_attainment", "traces_averaged"},
}
PROFILES = ("h20-longlive-1.3b-nvlink", "h200-wan-1.3b-measured")


# About a minute: the tests that use it are marked slow.
@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    traces = root / "traces"
    traces.mkdir()
    for name in ("bursty", "calm"):
        write_trace(
            generate(spec(name, seed=7, duration_s=240.0), name=f"short_{name}"),
            traces / f"short_{name}.csv.gz",
        )
    (traces / "notes.txt").write_text("not a trace")
    out = root / "out.json"
    plots = root / "plots"
    code = main(
        [
            "sim",
            "evaluate",
            "--traces",
            str(traces),
            "--quick",
            "--jobs",
            "1",
            "--placement-instances",
            "40",
            "--json",
            str(out),
            "--plots",
            str(plots),
        ]
    )
    return code, json.loads(out.read_text()), plots


@pytest.mark.slow
def test_the_json_has_its_documented_summary_keys(result):
    code, doc, _ = result
    assert code == 0
    summary = doc["summary"]
    for key, inner in SUMMARY_KEYS.items():
        assert inner <= set(summary[key]), key
        assert all(isinstance(summary[key][k], float | int) for k in inner)
    assert summary["oracle_is_lower_bound"] is True
    assert set(doc["traces"]) == {"short_bursty", "short_calm"}
    assert doc["placement"]["instances"] == 40
    assert summary["scale"] == 1 and doc["scale"] == 1  # --scale defaults to 1
    for key in (
        "cost_reduction_at_matched_slo_pct",
        "gap_to_boot_aware_floor_pct",
        "gap_to_clairvoyant_at_slo_pct",
    ):
        assert set(summary[key]["per_trace"]) == {"short_bursty", "short_calm"}, key
    assert set(summary["placement_mixed_kinds"]) == {"h20_h200", "crossing", "crossing_eta_1"}
    # Sweeps that missed 99% were extended up to the stated caps, and the JSON says so.
    ext = doc["config"]["sweep_extension"]
    assert ext["headroom_cap"] == 0.15 and ext["static_cap_factor"] == 2.0
    for t in doc["traces"].values():
        assert set(t["sweep_extension"]) == {"added", "static_cap_gpus", "not_reached_at_cap"}
    assert doc["config"]["runs"] >= ext["runs"]


@pytest.mark.slow
def test_both_profiles_are_evaluated(result):
    _, doc, _ = result
    assert tuple(doc["by_profile"]) == PROFILES
    assert doc["config"]["profile"] == PROFILES[0]
    h200 = doc["by_profile"][PROFILES[1]]
    assert h200["config"]["capacity"] == 2 and doc["config"]["capacity"] == 12
    assert set(h200["traces"]) == {"short_bursty", "short_calm"}
    for key in SUMMARY_KEYS:
        if key != "placement_gap_to_oracle_pct":  # measured once, on the first profile
            assert key in h200["summary"], key


@pytest.mark.slow
def test_service_level_is_what_an_operator_pays_for_99_percent(result):
    _, doc, _ = result
    for t in doc["traces"].values():
        v = t["service_level"]
        assert v["slo_attainment"] == 0.99
        for name, static in v["static"].items():
            if static["reached"]:  # the smallest pool of its sweep that serves 99%
                runs = [r for r in t["curves"][name] if r["stall_adjusted_attainment"] >= 0.99]
                assert static["cost_gpu_hours"] == pytest.approx(
                    min(r["cost_gpu_hours"] for r in runs), abs=1e-4
                )
        best = v["static"][v["best_baseline"]]["cost_gpu_hours"]
        ours = v["turboserve"]["cost_gpu_hours"]
        assert v["cost_reduction_vs_best_baseline_pct"] == pytest.approx(
            100 * (best - ours) / best, abs=0.01
        )


@pytest.mark.slow
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


@pytest.mark.slow
def test_plots_are_written(result):
    _, _, plots = result
    names = {p.name for p in plots.iterdir()}
    assert {"cost_latency_short_bursty.png", "cost_latency_short_calm.png"} <= names
    assert any(n.startswith("gpus_over_time_") for n in names)
    assert any(n.startswith("latency_cdf_") for n in names)


def test_an_empty_folder_is_an_error(tmp_path, capsys):
    assert main(["sim", "evaluate", "--traces", str(tmp_path)]) == 2
    assert "no .csv" in capsys.readouterr().err


@pytest.mark.slow
def test_tables_command_prints_the_readme_tables(result, tmp_path, capsys):
    _, doc, _ = result
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["sim", "tables", "--eval", str(path), "--no-bench"]) == 0
    out = capsys.readouterr().out
    assert "### `turboserve sim run --trace bursty --policy all`" in out
    assert "interpolated between" in out  # static pools at turboserve's cost
    assert "### Against the paper" in out and "h200-wan-1.3b-measured (K = 2)" in out
    assert "short_bursty" in out  # the per-trace cost to serve 99%
    assert "bench scheduler" not in out


def test_tables_command_refuses_what_is_not_an_evaluation(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["sim", "tables", "--eval", str(bad)]) == 2
    assert "not a sim evaluate document" in capsys.readouterr().err

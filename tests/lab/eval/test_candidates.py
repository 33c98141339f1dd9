"""A setting of a policy read against the bar's rivals: the figures each row carries, the
summary's counts, the settings' parsing."""

from __future__ import annotations

import pytest

from lab.eval import candidates
from lab.eval.runs import RunSpec, execute, prime_trace_cache
from lab.sim import synth
from lab.sim.catalog import load_trace
from lab.sim.traceio import write_trace


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> candidates.Rivals:
    path = tmp_path_factory.mktemp("candidates") / "short.csv"
    write_trace(synth.generate(synth.spec("steps", seed=7, duration_s=240.0)), path)
    return candidates.rivals(str(path), references=True)


def test_a_row_is_the_setting_over_its_rivals(found: candidates.Rivals) -> None:
    assert found.least_loaded_gpu_h is not None and found.best_static_gpu_h is not None
    assert found.best_static_gpu_h <= found.least_loaded_gpu_h
    row = candidates.candidate_row(found, "turboserve_staffing", {"confidence": 0.99})
    prime_trace_cache({found.key: load_trace(found.key)})
    again = execute(
        RunSpec(
            found.key,
            "turboserve_staffing",
            "turboserve_staffing",
            (("initial_gpus", found.initial_gpus), ("confidence", 0.99)),
        )
    )
    assert row["gpu_h"] == pytest.approx(again.cost_gpu_h, abs=1e-4)
    assert row["reached"] == (again.stall_adjusted_attainment >= 0.99)
    if row["reached"]:
        cheaper = found.cheaper_gpu_h
        assert cheaper is not None
        assert row["vs_cheaper_pct"] == pytest.approx(100 * (row["gpu_h"] / cheaper - 1), abs=0.05)
    assert row["hpa_scale_events"] == found.hpa_scale_events
    assert "clairvoyant_gpu_h" in row and found.turboserve_gpu_h is not None


def test_the_summary_counts_the_traces_a_setting_missed() -> None:
    def row(trace: str, reached: bool, pct: float | None, events: int) -> dict[str, object]:
        return {
            "trace": trace,
            "params": {"confidence": 0.9},
            "reached": reached,
            "vs_cheaper_pct": pct,
            "vs_best_static_pct": pct,
            "vs_clairvoyant_pct": None,
            "scale_events": events,
            "hpa_scale_events": 4,
        }

    (line,) = candidates.summary([row("a", True, -10.0, 4), row("b", False, None, 12)])
    assert "served 1/2" in line and "worst -10.0%" in line and "3.0x HPA" in line
    assert "missed on b" in line


def test_settings_parse_as_json_values() -> None:
    assert candidates._setting("confidence=0.9,burst_quantile=null,fill=1") == {
        "confidence": 0.9,
        "burst_quantile": None,
        "fill": 1,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        candidates._setting("confidence")


def test_settings_read_as_one_curve_interpolate_at_the_service_level() -> None:
    def row(confidence: float, gpu_h: float, attainment: float) -> dict[str, object]:
        return {
            "trace": "t",
            "params": {"confidence": confidence},
            "gpu_h": gpu_h,
            "attainment": attainment,
            "reached": attainment >= 0.99,
            "scale_events": 10,
            "hpa_scale_events": 5,
            "least_loaded_gpu_h": 5.0,
            "hpa_gpu_h": 4.0,
            "best_static_gpu_h": 5.0,
        }

    (curve,) = candidates.curve_rows([row(0.9, 3.0, 0.98), row(0.99, 4.0, 1.0)])
    # Halfway from 2% missed to 0% missed: halfway from 3 to 4 GPU-h.
    assert curve["gpu_h"] == pytest.approx(3.5)
    assert curve["vs_cheaper_pct"] == pytest.approx(-12.5)
    (missed,) = candidates.curve_rows([row(0.9, 3.0, 0.98)])
    assert missed["gpu_h"] is None and missed["best_attainment"] == 0.98

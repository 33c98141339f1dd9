"""The robustness bar's helper: the figure it reads, a candidate table's re-run, its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.eval import robustness
from lab.eval.service_level import curve_at_slo, static_at_slo
from lab.sim import synth
from lab.sim.traceio import write_trace
from services.scheduler.shipped import load_rho_table


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> robustness.TraceSweep:
    path = tmp_path_factory.mktemp("robustness") / "short.csv"
    write_trace(synth.generate(synth.spec("steps", seed=7, duration_s=240.0)), path)
    return robustness.sweep(str(path))


def test_bar_is_turboserve_over_the_cheaper_rival(swept: robustness.TraceSweep) -> None:
    assert {r.spec.curve for r in swept.runs} == set(robustness.CURVES)
    row = robustness.bar(swept, None)
    ours = curve_at_slo([r for r in swept.runs if r.spec.curve == "turboserve"])
    ll = static_at_slo([r for r in swept.runs if r.spec.curve == "least_loaded"])
    hpa = curve_at_slo([r for r in swept.runs if r.spec.curve == "hpa"])
    assert row.turboserve_gpu_h == ours["cost_gpu_hours"]
    rivals = [e["cost_gpu_hours"] for e in (ll, hpa) if e["reached"]]
    assert rivals and row.bar_pct == pytest.approx(100 * (ours["cost_gpu_hours"] / min(rivals) - 1))
    assert row.bar_pct is not None and row.met == (row.bar_pct <= robustness.BAR_PCT)


def test_a_candidate_changes_only_the_adaptive_run(swept: robustness.TraceSweep) -> None:
    shipped = load_rho_table()
    assert shipped is not None
    same = robustness.bar(swept, shipped, "again")
    assert same.adaptive_gpu_h == pytest.approx(swept.adaptive.cost_gpu_h)
    assert same.turboserve_gpu_h == robustness.bar(swept, None).turboserve_gpu_h
    # A table at rho_hat 0.35 everywhere holds far more GPUs: the adaptive run is re-run.
    raw = shipped.to_dict()
    for level in raw["levels"]:
        level.update(rho_hat=0.35, delta=0.1)
    loose = robustness.bar(swept, type(shipped).from_dict(raw), "loose")
    assert loose.adaptive_gpu_h > same.adaptive_gpu_h
    text = robustness.report([same, loose])
    assert "again: worst" in text and "loose: worst" in text


def test_a_bad_table_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"levels": []}))
    assert robustness.main(["--traces", "calm", "--table", str(bad)]) == 2
    assert "rho table" in capsys.readouterr().err


def test_level_shares_tell_chaotic_from_churny() -> None:
    table = load_rho_table()
    assert table is not None
    chaotic = robustness.level_shares("chaotic", table)
    churny = robustness.level_shares("churny", table)
    assert sum(chaotic) == pytest.approx(1.0) and sum(churny) == pytest.approx(1.0)
    assert sum(chaotic[7:]) > 0.9 > 0.1 > sum(churny[7:])


def test_an_unknown_trace_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert robustness.main(["--levels", "--traces", "no_such_trace"]) == 2
    assert "no_such_trace" in capsys.readouterr().err

"""Cost at the service level: what each policy pays to serve 99% of chunk periods on time."""

from __future__ import annotations

import pytest

from lab.eval.runs import RunSpec, RunSummary
from lab.eval.service_level import service_level as _service_level


def _run(curve: str, cost: float, stall: float, **params) -> RunSummary:
    return RunSummary(
        spec=RunSpec("t", curve, curve, tuple(params.items())),
        cost_gpu_h=cost,
        cost_usd=0.0,
        p50_ms=0.0,
        p99_ms=1000.0,
        max_ms=1000.0,
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


def _curves():
    static = {
        "least_loaded": [
            _run("least_loaded", g / 2, a, gpus=g)
            for g, a in ((6, 0.95), (7, 0.985), (8, 0.992), (9, 0.999))
        ],
        "round_robin": [
            _run("round_robin", g / 2, a, gpus=g) for g, a in ((6, 0.94), (8, 0.989), (10, 0.995))
        ],
        "memory_aware": [_run("memory_aware", g / 2, 0.9, gpus=g) for g in (6, 8, 10)],
    }
    ours = [
        _run("turboserve", 3.0, 0.97, rho_hat=0.9),
        _run("turboserve", 3.2, 0.985),
        _run("turboserve", 3.6, 0.995, rho_hat=0.7),
    ]
    hpa = [_run("hpa", 3.5, 0.98, target=0.9), _run("hpa", 4.5, 1.0, target=0.5)]
    return {**static, "turboserve": ours, "hpa": hpa}


def test_each_policy_pays_for_99_percent():
    curves = _curves()
    v = _service_level(curves, curves["turboserve"][1])
    # A static pool: the smallest count of the sweep that serves 99% (an operator buys GPUs).
    assert v["static"]["least_loaded"] == {
        "cost_gpu_hours": 4.0,
        "gpus": 8,
        "attainment": 0.992,
        "reached": True,
    }
    assert v["static"]["round_robin"]["gpus"] == 10
    assert v["static"]["memory_aware"]["reached"] is False  # never: its dearest, flagged
    assert v["best_baseline"] == "least_loaded"
    # Ours and HPA: their curve read at 1% of periods missed. Ours between 3.2 GPU-h (1.5%
    # missed) and 3.6 (0.5%): 3.4. HPA between 3.5 (2%) and 4.5 (0%): 4.0.
    assert v["turboserve"]["cost_gpu_hours"] == pytest.approx(3.4)
    assert v["rivals"]["hpa"]["cost_gpu_hours"] == pytest.approx(4.0)
    assert v["cost_reduction_vs_best_baseline_pct"] == pytest.approx(15.0)
    # Robustness: against the cheaper of least_loaded (4.0) and HPA (4.0): -15%.
    assert v["cost_vs_best_of_least_loaded_and_hpa_pct"] == pytest.approx(-15.0)
    assert v["turboserve"]["adaptive_meets"] is False
    # Service at our cost (3.2 GPU-h = 6.4 GPUs): least_loaded between 6 and 7 GPUs.
    assert v["attainment_at_our_cost"]["least_loaded"]["attainment"] == pytest.approx(
        0.95 + 0.035 * 0.4
    )


def test_the_gap_to_the_clairvoyant_is_our_cost_over_its_at_99_percent():
    from lab.eval.service_level import slo_summary

    curves = _curves()
    # The clairvoyant's curve read at 1% missed: between 2.0 GPU-h (2%) and 3.0 (0%): 2.5.
    curves["clairvoyant"] = [
        _run("clairvoyant", 2.0, 0.98, rho_hat=0.9),
        _run("clairvoyant", 3.0, 1.0, rho_hat=0.5),
    ]
    v = _service_level(curves, curves["turboserve"][1])
    assert v["rivals"]["clairvoyant"]["cost_gpu_hours"] == pytest.approx(2.5)
    assert v["gap_to_clairvoyant_at_slo_pct"] == pytest.approx(100 * (3.4 / 2.5 - 1))
    assert v["gap_to_clairvoyant_at_slo_reached"] is True
    # A clairvoyant that never serves 99%: no gap on that trace, and the summary says why.
    short = _curves()
    short["clairvoyant"] = [_run("clairvoyant", 2.0, 0.95, rho_hat=0.9)]
    w = _service_level(short, short["turboserve"][1])
    assert w["gap_to_clairvoyant_at_slo_reached"] is False
    block = slo_summary({"a": {"service_level": v}, "b": {"service_level": w}})[
        "gap_to_clairvoyant_at_slo_pct"
    ]
    assert block["per_trace"] == {"a": pytest.approx(36.0), "b": None}
    assert block["avg"] == pytest.approx(36.0) and block["max"] == pytest.approx(36.0)
    assert block["traces_averaged"] == 1 and block["left_out"] == {"b": ["clairvoyant"]}


def test_a_gap_read_where_a_cheapest_run_serves_more_is_a_bound():
    from lab.eval.service_level import slo_summary

    curves = _curves()
    # Every run of the clairvoyant serves more than 99%: its cost there is at most 2.0 GPU-h,
    # so our gap to it is at least what the figure says.
    curves["clairvoyant"] = [
        _run("clairvoyant", 2.0, 0.995, rho_hat=0.9),
        _run("clairvoyant", 3.0, 1.0, rho_hat=0.5),
    ]
    v = _service_level(curves, curves["turboserve"][1])
    assert v["rivals"]["clairvoyant"]["upper_bound"] is True
    assert v["gap_to_clairvoyant_at_slo_bound"] == "at least"
    block = slo_summary({"a": {"service_level": v}})["gap_to_clairvoyant_at_slo_pct"]
    assert block["bounds"] == {"a": "at least"} and block["traces_averaged"] == 1

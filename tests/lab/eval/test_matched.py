"""Matched comparisons on hand-made cost-latency curves."""

from __future__ import annotations

import pytest

from lab.eval.matched import (
    CurvePoint,
    cost_at_latency,
    cost_reduction_at_matched_latency,
    latency_at_cost,
    latency_reduction_at_matched_cost,
    pareto_envelope,
    reduction_pct,
)

# A rival: 100 $ -> 2000 ms, 200 $ -> 1000 ms, 400 $ -> 500 ms, plus a dominated point.
RIVAL = [
    CurvePoint(200, 1000),
    CurvePoint(100, 2000),
    CurvePoint(400, 500),
    CurvePoint(300, 1200),
]


def test_envelope_drops_dominated_points_and_sorts():
    env = pareto_envelope(RIVAL)
    assert [(p.cost, p.latency) for p in env] == [(100, 2000), (200, 1000), (400, 500)]


def test_latency_interpolates_between_neighbours():
    m = latency_at_cost(RIVAL, 300)
    assert m.reached and m.value == pytest.approx(750)


def test_latency_below_the_cheapest_point_is_clamped_and_flagged():
    m = latency_at_cost(RIVAL, 50)
    assert not m.reached and m.value == 2000


def test_cost_interpolates_between_neighbours():
    m = cost_at_latency(RIVAL, 1500)
    assert m.reached and m.value == pytest.approx(150)


def test_unreachable_latency_charges_the_dearest_point():
    m = cost_at_latency(RIVAL, 100)
    assert not m.reached and m.value == 400


def test_reductions_in_percent_of_the_rival():
    assert reduction_pct(200, 150) == pytest.approx(25)
    assert reduction_pct(100, 130) == pytest.approx(-30)
    lat, _ = latency_reduction_at_matched_cost(RIVAL, CurvePoint(300, 600))
    assert lat == pytest.approx(100 * (750 - 600) / 750)
    cost, _ = cost_reduction_at_matched_latency(RIVAL, CurvePoint(120, 1500))
    assert cost == pytest.approx(100 * (150 - 120) / 150)


def test_a_curve_without_finite_points_is_an_error():
    with pytest.raises(ValueError):
        pareto_envelope([CurvePoint(float("inf"), 1.0)])


def test_matches_outside_the_measured_range_are_flagged():
    assert not latency_at_cost(RIVAL, 500).reached
    assert latency_at_cost(RIVAL, 500).value == 500
    assert latency_at_cost(RIVAL, 400).reached
    high = cost_at_latency(RIVAL, 3000)
    assert not high.reached and high.value == 100
    assert cost_at_latency(RIVAL, 2000).reached


def test_a_rival_that_never_reaches_our_latency_is_not_the_best_match():
    from lab.eval.analysis import _best

    vs = {
        "never_reaches": {"rival_cost_gpu_hours": 3.0, "cost_match_in_range": False},
        "reaches": {"rival_cost_gpu_hours": 4.0, "cost_match_in_range": True},
        "dearer": {"rival_cost_gpu_hours": 5.0, "cost_match_in_range": True},
    }
    assert _best(vs, list(vs), "rival_cost_gpu_hours", "cost_match_in_range") == "reaches"
    none_in_range = {k: {**v, "cost_match_in_range": False} for k, v in vs.items()}
    assert (
        _best(none_in_range, list(vs), "rival_cost_gpu_hours", "cost_match_in_range")
        == "never_reaches"
    )

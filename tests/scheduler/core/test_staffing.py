"""``turboserve_staffing``: the demand model one boot ahead (the chain, the rates, the arrival
windows, square-root staffing) and the loop it sizes (scale-out ahead, ski-rental hold)."""

from __future__ import annotations

import math

import pytest

from services.scheduler.core.policies import LIVE_POLICIES
from services.scheduler.core.staffing import (
    BootWindows,
    RateEstimator,
    Rates,
    StaffingConfig,
    StaffingController,
    demand_ahead,
    outlooks,
    transition,
)
from services.scheduler.core.types import Drain, Event, EventKind, Release, RequestGpus
from shared.policies import LIVE_POLICIES as LIVE_NAMES
from shared.profile import load_profile

PROFILE = load_profile()
K = PROFILE.capacity


def _expm_first_column(rates: Rates, h: float) -> tuple[float, float]:
    """exp(Q h)'s first column by scaling and squaring its power series (the reference for
    the closed form)."""
    a, d, qa, qi = rates.values()
    squarings = 10
    step = h / 2**squarings
    q = [[-(d + qa) * step, d * step], [a * step, -(a + qi) * step]]

    def mul(x: list[list[float]], y: list[list[float]]) -> list[list[float]]:
        return [[sum(x[i][k] * y[k][j] for k in range(2)) for j in range(2)] for i in range(2)]

    term = [[1.0, 0.0], [0.0, 1.0]]
    total = [[1.0, 0.0], [0.0, 1.0]]
    for n in range(1, 20):
        term = [[v / n for v in row] for row in mul(term, q)]
        total = [[total[i][j] + term[i][j] for j in range(2)] for i in range(2)]
    for _ in range(squarings):
        total = mul(total, total)
    return total[0][0], total[1][0]


@pytest.mark.parametrize(
    "rates",
    [
        Rates(0.13, 0.065, 0.015, 0.017),
        Rates(0.5, 0.01, 0.0, 0.2),
        Rates(0.0, 0.05, 0.01, 0.0),
        Rates(0.02, 0.02, 0.0, 0.0),  # equal diagonal
    ],
)
def test_the_closed_form_is_the_matrix_exponential(rates):
    for h in (0.0, 5.0, 30.0, 120.0):
        assert transition(rates, h) == pytest.approx(_expm_first_column(rates, h), abs=1e-9)


def test_without_rates_sessions_keep_their_state_and_with_flips_tend_to_the_active_share():
    assert transition(Rates(), 30.0) == (1.0, 0.0)
    a, d = 0.2, 0.1
    p_aa, p_ia = transition(Rates(a, d, 0.0, 0.0), 1000.0)
    assert p_aa == pytest.approx(a / (a + d)) and p_ia == pytest.approx(a / (a + d))


def test_headroom_grows_as_the_square_root_of_the_load():
    chances = outlooks(Rates(0.13, 0.065, 0.015, 0.017), 30.0)  # no standard errors
    z = 2.0
    small = demand_ahead(40, 20, 10.0, chances, z)
    large = demand_ahead(240, 120, 60.0, chances, z)
    assert large.mean == pytest.approx(6 * small.mean)
    assert large.sd == pytest.approx(math.sqrt(6) * small.sd)
    assert large.sized - large.mean == pytest.approx(z * large.sd)
    # Relative headroom shrinks by sqrt(6) from one pool to six.
    rel_small = (small.sized - small.mean) / small.mean
    rel_large = (large.sized - large.mean) / large.mean
    assert rel_large == pytest.approx(rel_small / math.sqrt(6))


def test_the_rates_uncertainty_adds_to_the_variance():
    sure = Rates(0.13, 0.065, 0.015, 0.017)
    unsure = Rates(0.13, 0.065, 0.015, 0.017, sd=(0.03, 0.01, 0.005, 0.005))
    a = demand_ahead(100, 50, 20.0, outlooks(sure, 30.0), 1.0)
    b = demand_ahead(100, 50, 20.0, outlooks(unsure, 30.0), 1.0)
    assert b.mean == pytest.approx(a.mean) and b.sd > a.sd


def test_the_estimator_recovers_a_steady_rate_with_its_poisson_error():
    est = RateEstimator(window_s=120.0)
    # 50 active, 25 idle for 2000 s; every second one active session goes idle and one idle
    # session comes back (the populations stay put): 1/50 and 1/25 per session-second.
    for t in range(2000):
        est.advance(float(t), 50, 25)
        est.count(1)
        est.count(0)
    rates = est.rates()
    assert rates.deactivate == pytest.approx(1 / 50, rel=0.02)
    assert rates.activate == pytest.approx(1 / 25, rel=0.02)
    assert rates.leave_active == 0.0 and rates.leave_idle == 0.0
    # The error of a count of about 120 events (the window's worth) over its exposure, and
    # one event's worth for a rate never seen.
    assert rates.sd[1] == pytest.approx(rates.deactivate / math.sqrt(120), rel=0.05)
    assert rates.sd[2] > 0


def test_arrival_windows_read_the_quantile_of_boot_long_counts_and_skip_the_found_sessions():
    win = BootWindows(horizon_s=30.0, window_s=900.0)
    for _ in range(200):
        win.record(0.0)  # the sessions found running: not arrivals
    for t in range(1, 900):
        win.record(float(t))  # one a second
    assert win.quantile(900.0, 0.9) == 30.0
    # A burst of 60 in one bin shows in the top windows only.
    for _ in range(60):
        win.record(901.0)
    for t in range(900, 950):
        win.record(float(t))
    assert win.quantile(950.0, 0.5) == 30.0
    assert win.quantile(950.0, 1.0) == 90.0


def test_it_is_a_live_policy_with_its_config():
    assert "turboserve_staffing" in LIVE_NAMES and "turboserve_staffing" in LIVE_POLICIES
    config = LIVE_POLICIES.config("turboserve_staffing", {"confidence": 0.9, "gpus": 3})
    assert isinstance(config, StaffingConfig) and config.initial_gpus == 3
    assert config.hold_s == 6 * config.boot_delay_s
    for bad in ({"confidence": 1.0}, {"fill": 0.0}, {"burst_quantile": 2.0}):
        with pytest.raises(ValueError):
            LIVE_POLICIES.config("turboserve_staffing", bad)


def _controller(**params: object) -> StaffingController:
    config = LIVE_POLICIES.config("turboserve_staffing", {"boot_delay_s": 30.0, **params})
    policy = LIVE_POLICIES.build("turboserve_staffing", PROFILE, config)
    assert isinstance(policy, StaffingController)
    return policy


def _requested(out) -> int:
    return sum(len(d.gpu_ids) for d in out if isinstance(d, RequestGpus))


def test_it_asks_for_gpus_before_the_pool_is_full_when_arrivals_keep_coming():
    policy = _controller(confidence=0.9, initial_gpus=4, min_gpus=1)
    asked_at, t = None, 0.0
    for i in range(400):  # one arrival a second, sessions never flip nor leave
        t = float(i)
        out = policy.step(Event(t, EventKind.ARRIVE, session_id=f"s{i}"))
        if _requested(out):
            asked_at = i
            break
    assert asked_at is not None
    # It asks about one boot's arrivals (30) before the 4 GPUs (48 slots) are full.
    assert asked_at < 4 * K - 20
    assert not policy.view.pending


def test_a_higher_confidence_never_holds_fewer_gpus():
    def pool(confidence: float) -> float:
        policy = _controller(confidence=confidence, initial_gpus=1)
        for i in range(300):
            t = float(i)
            policy.step(Event(t, EventKind.ARRIVE, session_id=f"s{i}"))
            if i % 3 == 0 and i >= 3:
                policy.step(Event(t, EventKind.IDLE, session_id=f"s{i - 3}"))
        return sum(1 for _ in policy.view.gpus)

    assert pool(0.6) <= pool(0.9) <= pool(0.99)


def test_a_gpu_no_longer_needed_is_held_for_the_hold_before_it_goes():
    policy = _controller(confidence=0.9, initial_gpus=6, scale_in_delay_s=120.0, warmup_s=0.0)
    for i in range(60):
        policy.step(Event(0.0, EventKind.ARRIVE, session_id=f"s{i}"))
    for i in range(60):
        policy.step(Event(10.0, EventKind.DEPART, session_id=f"s{i}"))
    first_in = None
    for t in range(11, 400):
        out = policy.step(Event(float(t), EventKind.TICK))
        if any(isinstance(d, Drain | Release) for d in out):
            first_in = t
            break
    # The targets of the hold's window include the one of t = 10 (before the departures were
    # applied the loop sized for 60 sessions): nothing goes before t = 10 + 120.
    assert first_in is not None and 120 <= first_in <= 135


def test_over_dispersed_arrivals_and_storms_add_headroom():
    chances = outlooks(Rates(0.13, 0.065, 0.015, 0.017), 30.0)
    poisson = demand_ahead(60, 40, 20.0, chances, 2.0)
    bursty = demand_ahead(60, 40, 20.0, chances, 2.0, arrivals_var=400.0)
    stormy = demand_ahead(60, 40, 20.0, chances, 2.0, wake_var=0.04)
    assert bursty.mean == pytest.approx(poisson.mean) and bursty.sd > poisson.sd
    p_new = chances[0].p_new
    assert bursty.sd**2 - poisson.sd**2 == pytest.approx(p_new**2 * 400.0)
    assert stormy.sd**2 - poisson.sd**2 == pytest.approx(p_new**2 * 40**2 * 0.04)


def test_boot_windows_read_the_moments_of_their_counts():
    win = BootWindows(horizon_s=30.0, window_s=900.0)
    win.observe(0.0)
    for t in range(1, 900):
        win.record(float(t), base=10)
    mean, var = win.moments(900.0)
    assert mean == pytest.approx(30.0, abs=1.0) and var < 1.0
    share_mean, _ = win.share_moments(900.0)
    assert share_mean == pytest.approx(1.0)  # 30 wakes over 10 idle: capped at all of them


def test_the_latest_window_is_read_for_a_surge():
    win = BootWindows(horizon_s=30.0, window_s=900.0)
    win.observe(0.0)
    for t in range(1, 870):
        if t % 3 == 0:
            win.record(float(t))  # one every 3 s: 10 a boot
    for t in range(870, 900):
        for _ in range(5):
            win.record(float(t))  # a surge: 150 in the last boot
    mean, _ = win.moments(900.0)
    assert mean < 20.0 and win.latest(900.0) == 150.0


def test_the_recent_rate_sees_a_surge_before_a_whole_window_does():
    win = BootWindows(horizon_s=30.0, window_s=900.0)
    win.observe(0.0)
    for t in range(1, 890):
        if t % 3 == 0:
            win.record(float(t))  # 10 a boot
    for t in range(890, 900):
        for _ in range(3):
            win.record(float(t))  # 3 a second for the last 10 s: 90 a boot
    assert win.latest(900.0) < 45.0  # the last whole boot dilutes the onset
    assert win.recent(900.0, 10.0) == pytest.approx(90.0, rel=0.05)


def test_churn_slots_keep_room_on_each_gpu_for_the_batch_being_refilled():
    def pool(**params: object) -> int:
        policy = _controller(confidence=0.9, initial_gpus=1, **params)
        for i in range(300):
            t = float(i)
            policy.step(Event(t, EventKind.ARRIVE, session_id=f"s{i}"))
            if i >= 2:
                policy.step(Event(t, EventKind.IDLE, session_id=f"s{i - 2}"))
                policy.step(Event(t, EventKind.ACTIVE, session_id=f"s{i - 2}"))
        return sum(1 for _ in policy.view.gpus)

    assert pool(churn_slots=10.0) > pool(churn_slots=1.0) >= pool()
    # beside the demand's headroom, not on top of it: between none and the sum of both
    beside = pool(churn_slots=10.0, churn_beside=True)
    assert pool() <= beside <= pool(churn_slots=10.0)
    assert beside > pool()  # this much churn is more than the spread's headroom
    for bad in ({"churn_slots": -1.0}, {"surge_recent_s": 0.0}):
        with pytest.raises(ValueError):
            LIVE_POLICIES.config("turboserve_staffing", bad)


def test_a_band_makes_fewer_larger_scale_outs():
    def events(**params: object) -> int:
        policy = _controller(confidence=0.9, initial_gpus=1, **params)
        for i in range(300):
            policy.step(Event(float(i), EventKind.ARRIVE, session_id=f"s{i}"))
        return policy.scale_events

    assert events(band=0.3) < events()
    with pytest.raises(ValueError):
        LIVE_POLICIES.config("turboserve_staffing", {"band": 1.0})

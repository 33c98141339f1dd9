"""The floor oracle: exact values on hand-made traces, and the closed form against HiGHS."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.eval.floor import (
    DemandStep,
    active_steps,
    floor_gpu_seconds,
    floor_with_boot_gpu_seconds,
    floor_with_boot_lp,
    gpu_need_steps,
)


def test_active_steps_follow_the_lifecycle():
    rows = [
        (0.0, "a", "arrive"),
        (1.0, "b", "arrive"),
        (3.0, "a", "idle"),
        (4.0, "a", "active"),
        (6.0, "b", "depart"),
        (6.0, "a", "depart"),
    ]
    assert active_steps(rows) == [
        DemandStep(0.0, 1.0, 1),
        DemandStep(1.0, 3.0, 2),
        DemandStep(3.0, 4.0, 1),
        DemandStep(4.0, 6.0, 2),
    ]


def test_sessions_without_depart_run_to_the_given_end():
    steps = active_steps([(0.0, "a", "arrive"), (2.0, "b", "arrive")], t_end=5.0)
    assert steps == [DemandStep(0.0, 2.0, 1), DemandStep(2.0, 5.0, 2)]


def test_time_going_backwards_is_an_error():
    with pytest.raises(ValueError, match="backwards"):
        active_steps([(2.0, "a", "arrive"), (1.0, "b", "arrive")])


def test_floor_is_the_integral_of_the_ceiling():
    # 5 active for 10 s, 2 active for 4 s, 9 active for 1 s; K = 4.
    steps = [DemandStep(0, 10, 5), DemandStep(10, 14, 2), DemandStep(14, 15, 9)]
    assert floor_gpu_seconds(steps, 4) == pytest.approx(10 * 2 + 4 * 1 + 1 * 3)


def test_need_steps_merge_equal_runs():
    steps = [DemandStep(0, 1, 3), DemandStep(1, 2, 4), DemandStep(2, 3, 5)]
    assert gpu_need_steps(steps, 4) == [DemandStep(0, 2, 1), DemandStep(2, 3, 2)]


def test_boot_floor_bridges_short_gaps_and_reboots_after_long_ones():
    # One GPU needed on [0,10), [12,20) and [50,60); boot delay 5 s.
    steps = [
        DemandStep(0, 10, 1),
        DemandStep(10, 12, 0),
        DemandStep(12, 20, 1),
        DemandStep(20, 50, 0),
        DemandStep(50, 60, 1),
    ]
    # Serving 28 s; the 2 s gap is bridged (2 < 5); the 30 s gap means a reboot paid 5 s.
    assert floor_with_boot_gpu_seconds(steps, 1, 5.0) == pytest.approx(28 + 2 + 5)
    assert floor_with_boot_lp(steps, 1, 5.0) == pytest.approx(28 + 2 + 5)


def test_boot_before_the_trace_starts_is_free():
    steps = [DemandStep(0, 2, 0), DemandStep(2, 10, 1)]
    assert floor_with_boot_gpu_seconds(steps, 1, 30.0) == pytest.approx(8 + 2)


demand = st.lists(
    st.tuples(st.floats(0.1, 20.0, allow_nan=False), st.integers(0, 30)),
    min_size=1,
    max_size=25,
)


def _steps(pairs):
    out, t = [], 0.0
    for length, active in pairs:
        out.append(DemandStep(t, t + length, active))
        t += length
    return out


@settings(max_examples=40, deadline=None)
@given(demand, st.integers(1, 8), st.floats(0.0, 40.0, allow_nan=False))
def test_closed_form_matches_the_lp(pairs, capacity, boot):
    steps = _steps(pairs)
    closed = floor_with_boot_gpu_seconds(steps, capacity, boot)
    assert closed == pytest.approx(floor_with_boot_lp(steps, capacity, boot), rel=1e-7, abs=1e-6)
    assert closed >= floor_gpu_seconds(steps, capacity) - 1e-9


@settings(max_examples=60, deadline=None)
@given(demand, st.integers(1, 8), st.integers(0, 3))
def test_any_feasible_schedule_costs_at_least_the_floor(pairs, capacity, slack):
    # A schedule with slack spare GPUs and a staircase that only ever grows is feasible.
    steps = _steps(pairs)
    running_max = 0
    cost = 0.0
    for s in steps:
        running_max = max(running_max, math.ceil(s.active / capacity))
        cost += (s.t_end - s.t) * (running_max + slack)
    assert cost >= floor_gpu_seconds(steps, capacity) - 1e-9

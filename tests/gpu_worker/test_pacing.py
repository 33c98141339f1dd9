"""Playback pacing (pure): due times, who takes a pass, chunk-time estimates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gpu_worker.pacing import ChunkEstimate, PlaybackClock, plan_pass


def test_clock_moves_by_the_period_and_slips_after_a_late_chunk():
    clock = PlaybackClock(due=10.0)
    assert clock.chunk_done(9.9, 0.75) == 10.0  # on time, 100 ms ahead
    assert clock.last_lead_ms == pytest.approx(100.0)
    assert clock.due == pytest.approx(10.75)
    assert clock.chunk_done(11.0, 0.75) == pytest.approx(10.75)  # 250 ms late: the viewer stalls
    assert clock.last_lead_ms == pytest.approx(-250.0)
    assert clock.due == pytest.approx(11.75)  # one period after the late chunk arrived
    clock.chunk_done(12.0, 0.0)  # no pacing: always due now
    assert clock.due == 12.0


def test_mid_chunk_and_due_sessions_take_the_pass_early_ones_wait():
    plan = plan_pass(
        now=100.0,
        sessions=[
            ("mid", False, 200.0),
            ("late", True, 99.0),
            ("ahead", True, 101.0),
            ("just", True, 100.75),
        ],
        lead_s=0.75,
        chunk_estimate_s=0.1,
    )
    assert plan.participants == ["mid", "late", "just"]
    assert plan.waiting == ["ahead"]
    assert plan.next_start == pytest.approx(101.0 - 0.75)
    assert plan.wait_s(100.0) == 0.0


def test_a_chunk_slower_than_the_lead_starts_early_enough():
    plan = plan_pass(now=0.0, sessions=[("s", True, 1.0)], lead_s=0.25, chunk_estimate_s=0.9)
    assert plan.participants == []
    assert plan.next_start == pytest.approx(0.1)  # due - estimated chunk time
    assert plan.wait_s(0.0) == pytest.approx(0.1)
    assert plan_pass(0.0, [], 0.75, 0.0).wait_s(0.0) is None  # nobody: wait for a command


@given(
    now=st.floats(0, 1e4),
    dues=st.lists(st.tuples(st.booleans(), st.floats(0, 1e4)), max_size=20),
    lead=st.floats(0, 5),
    est=st.floats(0, 5),
)
def test_every_session_is_planned_once_and_no_due_session_waits(now, dues, lead, est):
    sessions = [(f"s{i}", boundary, due) for i, (boundary, due) in enumerate(dues)]
    plan = plan_pass(now, sessions, lead, est)
    assert sorted(plan.participants + plan.waiting) == sorted(s for s, _, _ in sessions)
    for sid, boundary, due in sessions:
        if not boundary or due <= now:
            assert sid in plan.participants
    if plan.waiting:
        assert plan.next_start is not None and plan.next_start > now


def test_chunk_estimate_from_measured_passes():
    estimate = ChunkEstimate(passes_per_chunk=5, pass_ms={1: 10.0, 4: 20.0})
    assert estimate.chunk_s(1) == pytest.approx(0.05)
    assert estimate.chunk_s(4) == pytest.approx(0.10)
    assert estimate.chunk_s(8) == pytest.approx(0.20)  # scaled up from batch 4
    assert estimate.chunk_s(2) == pytest.approx(0.10)  # batch 1 (nearest) scaled up, the safe side
    assert ChunkEstimate(5).chunk_s(3) == 0.0  # nothing measured yet

"""`turboserve chaos`, short: a replay through a mesh whose components are killed and restarted
(a worker, the scheduler leader, a gateway, NATS, Redis); viewers lose nothing."""

from __future__ import annotations

import pytest

from tools.chaos import ACTIONS, chaos, trace

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_trace_is_bounded_and_seeded():
    events = trace(8, 100.0, seed=3)
    assert events == trace(8, 100.0, seed=3) and events != trace(8, 100.0, seed=4)
    arrivals = [t for t, _, kind in events if kind == "arrive"]
    departures = [t for t, _, kind in events if kind == "depart"]
    assert len(arrivals) == len(departures) == 8
    assert max(departures) <= 85.0  # every session is gone before the run ends


async def test_nothing_is_lost_while_components_die():
    result = await chaos(duration_s=75.0, seed=7, sessions=6, actions=len(ACTIONS), kinds=ACTIONS)
    assert {a["action"] for a in result["actions"]} >= {"redis", "nats"}, result["actions"]
    assert result["sessions_started"] == 6 and result["refused"] == 0
    assert result["chunks"] > 6 * 10
    assert result["chunks_lost"] == 0 and result["seq_gaps"] == 0
    assert result["seq_repeats"] == 0 and result["silent_restarts"] == 0

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
    """With TLS on NATS and Redis, as `turboserve up` runs them (a restarted Redis comes back
    behind the same TLS front, a restarted NATS with the same certificates)."""
    result = await chaos(duration_s=75.0, seed=7, sessions=6, actions=len(ACTIONS), kinds=ACTIONS)
    assert result["tls"] is True
    assert {a["action"] for a in result["actions"]} >= {"redis", "nats"}, result["actions"]
    assert result["sessions_started"] == 6 and result["refused"] == 0
    assert result["chunks"] > 6 * 10
    assert result["chunks_lost"] == 0 and result["seq_gaps"] == 0
    assert result["seq_repeats"] == 0 and result["silent_restarts"] == 0


async def test_nothing_is_lost_across_broker_failovers():
    """On clustered brokers (three NATS nodes as one JetStream cluster, a Redis primary with two
    replicas and three sentinels): the NATS node that leads the chunk stream is killed (and
    started again 15 s later), then the Redis primary (its replica promoted); viewers lose
    nothing, and each fault's stall is measured."""
    kinds = ("nats-leader", "redis-primary")
    result = await chaos(duration_s=75.0, seed=5, sessions=5, actions=2, kinds=kinds, ha=True)
    assert result["ha"] is True and result["tls"] is True
    assert sorted(f["fault"] for f in result["faults"]) == sorted(kinds), result["actions"]
    details = " | ".join(a["detail"] for a in result["actions"])
    assert "(the chunk stream's leader)" in details and "the sentinels promoted" in details
    assert "not caught up" not in details, details
    assert result["sessions_started"] == 5 and result["refused"] == 0
    assert result["chunks"] > 5 * 10
    assert result["chunks_lost"] == 0 and result["seq_gaps"] == 0
    assert result["seq_repeats"] == 0 and result["silent_restarts"] == 0
    for fault in result["faults"]:
        assert fault["longest_stall_s"] >= 0 and fault["window_s"] > 0
        assert fault["scheduler_pause_s"] is not None  # the scheduler's ticks were seen

"""The quality budget in the pool ledger: a worker that rejoins under the same id starts from
full steps, whatever a late decision set for it after it left."""

from __future__ import annotations

from services.scheduler.ledger import PoolLedger
from shared.wire import Heartbeat, WorkerStatus


def _beat(at: float, steps: int) -> Heartbeat:
    return Heartbeat(
        worker_id="g1",
        status=WorkerStatus.READY,
        capacity=4,
        active=0,
        at=at,
        steps=steps,
        full_steps=4,
        min_steps=2,
    )


def test_a_budget_set_after_the_worker_left_does_not_follow_it_back() -> None:
    p = PoolLedger(10.0, 60.0, 1.0)
    p.join("g1", "H20", 0.0)
    p.leave("g1")
    # A SetSteps the core decided while it still held g1, carried out after the leave.
    p.want_steps("g1", 2)
    p.steps_sent("g1", 1.0)
    # g1 comes back (a restarted worker): the core holds it at full steps, and so does the
    # ledger, so its full-step heartbeats are not answered with the stale budget.
    p.join("g1", "H20", 2.0)
    assert p.steps_to_resend(_beat(3.0, 4)) is None
    assert "g1" not in p.steps_wanted

"""A worker's command checks against a real Redis: the leading term and the session's epoch,
read in one step; an outdated term refused without asking."""

from __future__ import annotations

import pytest

from services.gpu_worker.fencing import CommandFence, Faults
from shared.leader import leader_key
from shared.registry import Registry
from shared.states import SessionState
from shared.wire import WorkerCmdKind, WorkerCommand

pytestmark = pytest.mark.integration


@pytest.fixture
def registry(redis_client, isolation) -> Registry:
    return Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])


def assign(epoch: int, term: int, session_id: str = "s") -> WorkerCommand:
    return WorkerCommand(
        kind=WorkerCmdKind.ASSIGN, worker_id="w1", session_id=session_id, epoch=epoch, term=term
    )


async def test_a_command_passes_only_at_the_leading_term_and_its_epoch(registry, redis_client):
    fence = CommandFence(registry, "w1")
    await redis_client.set(leader_key(registry.ns), "7:sched-a")
    await registry.create_session("s", "p", 0)
    epoch = (await registry.place("s", "w1")).record.epoch
    assert await fence.faults(assign(epoch, 7), session=True) == Faults()
    assert await fence.faults(assign(epoch, 0), session=True) == Faults()  # an operator's
    stale = await fence.faults(assign(epoch - 1, 7), session=True)
    assert stale.epoch == f"registry has owner w1 at epoch {epoch}, command epoch {epoch - 1}"
    assert (await fence.faults(assign(0, 7, "ghost"), session=True)).epoch == "no such session"
    deposed = await fence.faults(assign(epoch, 6), session=True)
    assert deposed == Faults(leader="term 6 no longer leads the scheduling")
    # a session's epoch is not asked about when the caller does not check it (a STOP's)
    assert await fence.faults(assign(epoch - 1, 7), session=False) == Faults()


async def test_a_session_taken_away_fences_its_old_owner(registry, redis_client):
    fence = CommandFence(registry, "w1")
    await redis_client.set(leader_key(registry.ns), "7:sched-a")
    await registry.create_session("s", "p", 0)
    first = (await registry.place("s", "w1")).record
    assert await fence.faults(assign(first.epoch, 7), session=True) == Faults()
    await registry.transition("s", SessionState.PENDING, expected_epoch=first.epoch, owner=None)
    await registry.place("s", "w2")
    moved = await fence.faults(assign(first.epoch, 7), session=True)
    assert moved.epoch.startswith("registry has owner w2 at epoch 3")


async def test_a_term_older_than_one_seen_leading_is_refused_without_asking(registry, redis_client):
    fence = CommandFence(registry, "w1")
    key = leader_key(registry.ns)
    await redis_client.set(key, "6:sched-b")
    steps = WorkerCommand(kind=WorkerCmdKind.STEPS, worker_id="w1", steps=2, term=6)
    assert await fence.faults(steps, session=False) == Faults()
    # Terms only grow, so term 5 never leads again; were the registry asked, it would say so.
    await redis_client.set(key, "5:sched-a")
    older = WorkerCommand(kind=WorkerCmdKind.STEPS, worker_id="w1", steps=2, term=5)
    assert (await fence.faults(older, session=False)).leader
    await redis_client.delete(key)  # nobody leads: every term is refused
    assert (await fence.faults(steps, session=False)).leader

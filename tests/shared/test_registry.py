"""The registry against a real Redis: atomic ownership, fencing, workers."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis.asyncio as aioredis

from shared.registry import (
    TERMINATED_TTL_S,
    Fencing,
    GuardFailed,
    Registry,
    SessionExists,
    SessionNotFound,
    StaleEpoch,
    WorkerRecord,
)
from shared.states import IllegalTransition, SessionState
from shared.wire import SessionInput, WorkerStatus
from tests.eventually import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def registry(redis_client, isolation) -> Registry:
    return Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])


async def test_create_and_read(registry):
    rec = await registry.create_session("s1", "a fox", 7)
    assert rec.state is SessionState.PENDING and rec.epoch == 0 and rec.last_seq == -1
    got = await registry.get_session("s1")
    assert got == rec
    assert await registry.pending_sessions() == ["s1"]
    with pytest.raises(SessionExists):
        await registry.create_session("s1", "again", 1)
    assert await registry.get_session("nope") is None
    assert rec.input is SessionInput.TEXT and rec.strength is None


async def test_a_video_session_keeps_its_input_and_strength(registry):
    rec = await registry.create_session("v1", "in ink", 3, input=SessionInput.VIDEO, strength=0.6)
    got = await registry.get_session("v1")
    assert got == rec and got.input is SessionInput.VIDEO and got.strength == 0.6
    assert got.to_public()["input"] == "video" and got.to_public()["strength"] == 0.6
    await registry.set_prompt("v1", "in watercolour")  # the strength stays
    got = await registry.get_session("v1")
    assert got is not None and (got.prompt, got.strength) == ("in watercolour", 0.6)
    await registry.set_prompt("v1", "in oil", strength=0.25)
    got = await registry.get_session("v1")
    assert got is not None and (got.prompt, got.strength) == ("in oil", 0.25)


async def test_two_claimants_exactly_one_wins(infra, registry, isolation):
    """Many rounds of two workers claiming the same session over separate connections."""
    ns = isolation["TURBOSERVE_REDIS_NAMESPACE"]
    other_client = aioredis.from_url(infra.redis_url, socket_timeout=30)
    other = Registry(other_client, ns)
    try:
        for i in range(40):
            sid = f"race{i}"
            await registry.create_session(sid, "p", 0)
            results = await asyncio.gather(
                registry.claim(sid, "w1", expected_epoch=0),
                other.claim(sid, "w2", expected_epoch=0),
                return_exceptions=True,
            )
            wins = [r for r in results if not isinstance(r, BaseException)]
            losses = [r for r in results if isinstance(r, BaseException)]
            assert len(wins) == 1, results
            assert len(losses) == 1 and isinstance(losses[0], (StaleEpoch, IllegalTransition))
            final = await registry.get_session(sid)
            assert final.owner == wins[0].owner and final.epoch == 1
            assert final.state is SessionState.EXECUTING
            assert (await registry.placement())[sid] == final.owner
    finally:
        await other_client.aclose()


async def test_fencing_stops_a_stale_owner(registry):
    await registry.create_session("s", "p", 0)
    first = await registry.claim("s", "w1", expected_epoch=0)
    assert await registry.record_progress("s", "w1", first.epoch, 0)
    # w1 dies; the session is requeued and claimed by w2
    requeued = await registry.transition(
        "s", SessionState.PENDING, expected_epoch=first.epoch, owner=None
    )
    assert requeued.owner is None and "s" not in await registry.placement()
    second = await registry.claim("s", "w2", expected_epoch=requeued.epoch)
    assert second.epoch == first.epoch + 2
    # the old owner can no longer write, the new one can
    assert not await registry.record_progress("s", "w1", first.epoch, 1)
    assert await registry.record_progress("s", "w2", second.epoch, 1)
    assert (await registry.get_session("s")).last_seq == 1
    # progress never goes backwards
    assert await registry.record_progress("s", "w2", second.epoch, 0)
    assert (await registry.get_session("s")).last_seq == 1


async def test_illegal_and_missing(registry):
    await registry.create_session("s", "p", 0)
    with pytest.raises(IllegalTransition):
        await registry.transition("s", SessionState.SUSPENDED)
    with pytest.raises(SessionNotFound):
        await registry.transition("ghost", SessionState.EXECUTING)
    with pytest.raises(StaleEpoch) as info:
        await registry.claim("s", "w", expected_epoch=5)
    assert info.value.actual == 0


async def test_terminate_clears_placement_and_expires(registry, redis_client):
    await registry.create_session("s", "p", 0)
    rec = await registry.claim("s", "w1", 0)
    done = await registry.transition("s", SessionState.TERMINATED)
    assert (
        done.state is SessionState.TERMINATED and done.owner == "w1" and done.epoch == rec.epoch + 1
    )
    assert "s" not in await registry.placement()
    ttl = await redis_client.ttl(registry.session_key("s"))
    assert 0 < ttl <= TERMINATED_TTL_S
    with pytest.raises(IllegalTransition):
        await registry.transition("s", SessionState.PENDING)
    # a terminated session takes no progress
    assert not await registry.record_progress("s", "w1", done.epoch, 3)


async def test_workers_and_heartbeat_ttl(registry):
    w = WorkerRecord(
        id="w1", status=WorkerStatus.READY, capacity=8, chunk_ms={1: 12.5}, mem_free_bytes=10
    )
    await registry.register_worker(w, ttl_s=0.3)
    [got] = await registry.workers()
    assert (
        got.alive and got.capacity == 8 and got.chunk_ms == {1: 12.5} and got.mem_free_bytes == 10
    )

    async def expired() -> bool:
        return not (await registry.workers())[0].alive

    await eventually(expired, 5, "the heartbeat's TTL to expire")
    await registry.heartbeat(dataclasses.replace(w, chunks_unpublished=3), ttl_s=5)
    [got] = await registry.workers()
    assert got.alive and got.chunks_unpublished == 3  # what ctl status shows per worker
    await registry.set_worker_status("w1", WorkerStatus.DRAINING)
    assert (await registry.workers())[0].status is WorkerStatus.DRAINING
    await registry.remove_worker("w1")
    assert await registry.workers() == []


async def test_create_never_overwrites_an_existing_session(registry):
    await registry.create_session("keep", "original", 1)
    owned = await registry.claim("keep", "w1", expected_epoch=0)
    assert await registry.record_progress("keep", "w1", owned.epoch, 7)
    with pytest.raises(SessionExists):
        await registry.create_session("keep", "intruder", 2)
    after = await registry.get_session("keep")
    assert after.prompt == "original" and after.epoch == owned.epoch and after.last_seq == 7
    assert after.state is SessionState.EXECUTING
    assert "keep" not in await registry.pending_sessions()


async def test_place_reads_and_claims_a_pending_session_in_one_step(registry):
    await registry.create_session("s", "a fox", 7, token_hash="h", owner_key="k")
    placed = await registry.place("s", "w1")
    assert placed.won
    rec = placed.record
    assert rec.state is SessionState.EXECUTING and rec.owner == "w1" and rec.epoch == 1
    assert (rec.prompt, rec.seed, rec.last_seq, rec.token_hash) == ("a fox", 7, -1, "h")
    assert rec == await registry.get_session("s")  # what the script returned is what it wrote
    assert (await registry.placement())["s"] == "w1" and await registry.pending_sessions() == []
    # not pending any more: nothing written, the record returned as found
    again = await registry.place("s", "w2")
    assert not again.won and again.record == rec
    assert not (await registry.place("ghost", "w1")).won
    assert (await registry.place("ghost", "w1")).record is None


async def test_place_whatever_the_epoch_and_fences_the_old_owner(registry):
    await registry.create_session("s", "p", 0)
    first = (await registry.place("s", "w1")).record
    await registry.transition("s", SessionState.PENDING, expected_epoch=first.epoch, owner=None)
    second = (await registry.place("s", "w2")).record
    assert second.owner == "w2" and second.epoch == first.epoch + 2
    assert not await registry.record_progress("s", "w1", first.epoch, 0)
    assert await registry.record_progress("s", "w2", second.epoch, 0)


async def test_two_placements_exactly_one_wins(infra, registry, isolation):
    other_client = aioredis.from_url(infra.redis_url, socket_timeout=30)
    other = Registry(other_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    try:
        for i in range(40):
            sid = f"race{i}"
            await registry.create_session(sid, "p", 0)
            a, b = await asyncio.gather(registry.place(sid, "w1"), other.place(sid, "w2"))
            assert a.won != b.won
            winner = a if a.won else b
            loser = b if a.won else a
            assert loser.record == winner.record  # the loser sees the winner's claim
            assert (await registry.get_session(sid)).owner == winner.record.owner
    finally:
        await other_client.aclose()


async def test_place_under_a_guard_that_no_longer_holds_writes_nothing(registry, redis_client):
    await registry.create_session("s", "p", 0)
    lease_key = f"{registry.ns}:scheduler:leader"
    await redis_client.set(lease_key, "2:b")  # another scheduler leads now
    with pytest.raises(GuardFailed):
        await registry.place("s", "w1", guard=(lease_key, "1:a"))
    rec = await registry.get_session("s")
    assert rec.state is SessionState.PENDING and rec.owner is None and rec.epoch == 0


async def test_fencing_reads_the_leading_term_and_the_owner_together(registry, redis_client):
    assert await registry.fencing() == Fencing(term=None)
    lease_key = f"{registry.ns}:scheduler:leader"
    await redis_client.set(lease_key, "17:sched-a")
    assert await registry.fencing("ghost") == Fencing(term=17)
    await registry.create_session("s", "p", 0)
    assert await registry.fencing("s") == Fencing(term=17, found=True, owner=None, epoch=0)
    await registry.place("s", "w1")
    assert await registry.fencing("s") == Fencing(term=17, found=True, owner="w1", epoch=1)
    await redis_client.set(lease_key, "not-a-lease")
    assert (await registry.fencing()).term is None

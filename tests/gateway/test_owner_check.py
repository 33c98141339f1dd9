"""A feed relays a chunk or notice only from the owner the registry gave the session: any
worker credential can publish on any session's chunk subject, under any worker id and epoch.

The registry's owner is cached per feed (read when the feed starts) and read again only for
an epoch newer than the cache's, within a small budget: a new owner's first chunk is delivered
even before its notice, and a flood of forgeries costs a few Redis reads."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import redis.asyncio as aioredis

from services.gateway import owners as owners_module
from services.gateway.owners import REREAD_BURST, REREAD_EVERY_S, Owners
from shared.registry import Registry
from shared.states import SessionState
from shared.wire import NoticeKind
from tests.eventually import eventually
from tests.gateway.conftest import FakeWorker, bearer, create, read_sse
from tests.server_group import start_redis
from tools.servers import free_port, probe_redis

pytestmark = pytest.mark.integration


def _as(worker: FakeWorker, worker_id: str) -> FakeWorker:
    """Another publisher on the same connection, owner of nothing in the registry."""
    return FakeWorker(worker.nc, worker.subjects, worker_id)


def _chunks(events: list[dict[str, str]]) -> list[tuple[int, str, int]]:
    out = []
    for e in events:
        if e["event"] == "chunk":
            body = orjson.loads(e["data"])
            out.append((body["seq"], body["worker_id"], body["epoch"]))
    return out


async def _viewers(gw, sid: str, n: int) -> bool:
    return await gw.store.viewers(sid) >= n


async def _migrate(registry: Registry, sid: str, src: str, dst: str, epoch: int) -> int:
    """A migration's two registry steps, as the source and the destination make them: the
    epoch of the destination's ownership."""
    moving = await registry.transition(sid, SessionState.MIGRATING, expected_epoch=epoch, owner=src)
    moved = await registry.transition(
        sid, SessionState.EXECUTING, expected_epoch=moving.epoch, owner=dst
    )
    return moved.epoch


async def test_a_foreign_worker_and_a_forged_epoch_never_reach_a_viewer(http, gw, worker):
    s = await create(http)
    sid = s["id"]
    owner = _as(worker, "wreal")
    forger = _as(worker, "wforger")
    epoch = (await gw.ctx.registry.claim(sid, owner.worker_id, 0)).epoch
    async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
        await eventually(lambda: _viewers(gw, sid, 1))
        feed = gw.gateway.hub.feeds[sid]
        await owner.chunk(sid, 0, epoch=epoch)
        await forger.chunk(sid, 1, epoch=epoch)  # another worker, the owner's epoch
        await forger.chunk(sid, 1, epoch=epoch + 1)  # another worker, a newer epoch
        await owner.chunk(sid, 1, epoch=epoch + 7)  # the owner, under an epoch it was not given
        await forger.notice(sid, NoticeKind.RESTARTED, 1, epoch=epoch + 9)
        await owner.chunk(sid, 1, epoch=epoch)
        await owner.chunk(sid, 2, epoch=epoch)
        events = await read_sse(stream, want=3)
        # The gateway's own StreamEnd (no owner on it) still ends the stream.
        resp = await http.delete(f"/v1/sessions/{sid}", headers=bearer(s["token"]))
        assert resp.status == 200
        end = await read_sse(stream, want=1)
    assert [e["event"] for e in events] == ["chunk"] * 3  # no forged notice either
    assert _chunks(events) == [(0, "wreal", epoch), (1, "wreal", epoch), (2, "wreal", epoch)]
    assert end[0]["event"] == "end"
    assert gw.gateway.hub.foreign_dropped == 4
    assert b"turboserve_gateway_foreign_owner_dropped_total 4.0" in gw.gateway.metrics.render()
    # The feed's start, then at most the budget for the newer epochs: none for the foreign
    # worker at the epoch the feed had read.
    assert 1 < feed.owners.reads <= 1 + REREAD_BURST


async def test_a_flood_of_forged_epochs_costs_a_few_registry_reads(http, gw, worker):
    s = await create(http)
    sid = s["id"]
    owner = _as(worker, "wreal")
    epoch = (await gw.ctx.registry.claim(sid, owner.worker_id, 0)).epoch
    async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
        await eventually(lambda: _viewers(gw, sid, 1))
        feed = gw.gateway.hub.feeds[sid]
        started = time.monotonic()
        for i in range(60):
            await _as(worker, f"wforger{i % 3}").chunk(sid, i, epoch=epoch + 1 + i)
        await owner.chunk(sid, 0, epoch=epoch)
        events = await read_sse(stream, want=1)
        elapsed = time.monotonic() - started
    assert _chunks(events) == [(0, "wreal", epoch)]
    assert gw.gateway.hub.foreign_dropped == 60
    assert feed.owners.reads <= 1 + REREAD_BURST + elapsed / REREAD_EVERY_S + 1


async def test_a_new_owner_is_delivered_from_its_first_chunk_with_no_gap(http, gw, worker):
    """Ownership moves twice: the first new owner's chunk arrives before its notice (the
    feed reads the registry for it), the second's notice comes first (the read is the
    notice's). The owner left behind is fenced off; every seq arrives once, in order."""
    registry = gw.ctx.registry
    s = await create(http)
    sid = s["id"]
    first, second, third = _as(worker, "wone"), _as(worker, "wtwo"), _as(worker, "wthree")
    e1 = (await registry.claim(sid, first.worker_id, 0)).epoch
    async with http.get(s["stream_url"], headers=bearer(s["token"])) as stream:
        await eventually(lambda: _viewers(gw, sid, 1))
        feed = gw.gateway.hub.feeds[sid]
        await first.chunk(sid, 0, epoch=e1)
        await first.chunk(sid, 1, epoch=e1)
        events = await read_sse(stream, want=2)
        e2 = await _migrate(registry, sid, first.worker_id, second.worker_id, e1)
        await second.chunk(sid, 2, epoch=e2)  # before its notice
        await second.notice(sid, NoticeKind.MIGRATED, 3, epoch=e2)
        await second.chunk(sid, 3, epoch=e2)
        await first.chunk(sid, 4, epoch=e1)  # the owner before: fenced off
        events += await read_sse(stream, want=3)
        e3 = await _migrate(registry, sid, second.worker_id, third.worker_id, e2)
        await third.notice(sid, NoticeKind.MIGRATED, 4, epoch=e3)
        await third.chunk(sid, 4, epoch=e3)
        await third.chunk(sid, 5, epoch=e3)
        events += await read_sse(stream, want=3)
    assert [e["event"] for e in events] == [
        *["chunk"] * 3,
        "state",
        "chunk",
        "state",
        "chunk",
        "chunk",
    ]
    assert _chunks(events) == [
        (0, "wone", e1),
        (1, "wone", e1),
        (2, "wtwo", e2),
        (3, "wtwo", e2),
        (4, "wthree", e3),
        (5, "wthree", e3),
    ]
    assert gw.gateway.hub.foreign_dropped == 0  # the fenced chunk is a stale one
    assert feed.owners.reads <= 3  # the start, and one per new owner at most


async def test_a_late_viewer_replays_the_owners_before_and_not_a_forger(http, gw, worker):
    """What the stream retained from an owner the session has since left is history: a feed
    that starts after the migration has no registry read for it, and replays it."""
    registry = gw.ctx.registry
    s = await create(http)
    sid = s["id"]
    first, second, forger = _as(worker, "wone"), _as(worker, "wtwo"), _as(worker, "wforger")
    e1 = (await registry.claim(sid, first.worker_id, 0)).epoch
    await first.chunk(sid, 0, epoch=e1)
    await first.chunk(sid, 1, epoch=e1)
    e2 = await _migrate(registry, sid, first.worker_id, second.worker_id, e1)
    await second.chunk(sid, 2, epoch=e2)
    await forger.chunk(sid, 3, epoch=e2)  # the current epoch, not its owner
    await second.chunk(sid, 3, epoch=e2)
    await worker.nc.flush()
    async with http.get(
        s["stream_url"], params={"from": "start"}, headers=bearer(s["token"])
    ) as stream:
        events = await read_sse(stream, want=4)
    assert _chunks(events) == [(0, "wone", e1), (1, "wone", e1), (2, "wtwo", e2), (3, "wtwo", e2)]


async def test_the_owner_cache_decides_without_redis_below_the_epoch_it_read(
    redis_client, isolation
):
    registry = Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    await registry.create_session("s", "a fox", 1)
    owners = Owners(registry, "s")
    await owners.load()
    assert owners.current == ("", 0) and owners.reads == 1
    epoch = (await registry.claim("s", "wa", 0)).epoch
    assert owners.verdict("wa", epoch, history=False) is None  # newer than the read: ask
    assert await owners.admits("wa", epoch, history=False) and owners.reads == 2
    assert owners.verdict("wa", epoch, history=False) is True  # cached now
    assert owners.verdict("wb", epoch, history=False) is False  # one owner per epoch
    assert owners.verdict("wa", 0, history=True) is False  # epoch 0 had no owner
    # a forged epoch above the registry's: read once per budget, never admitted
    for _ in range(50):
        assert not await owners.admits("wa", epoch + 5, history=False)
    assert owners.reads <= 2 + REREAD_BURST + 1
    # an epoch below the newest read that the cache never read: history only
    await registry.transition("s", SessionState.PENDING, expected_epoch=epoch, owner=None)
    await registry.claim("s", "wc", epoch + 1)
    late = Owners(registry, "s")  # a feed that started after: it never read epoch 1
    await late.load()
    assert late.verdict("wa", epoch, history=True) is True
    assert late.verdict("wa", epoch, history=False) is False


async def test_a_registry_that_cannot_answer_holds_the_message_rather_than_drop_it(
    tmp_path, monkeypatch
):
    """Ownership moved, then Redis went away before the new owner's first chunk reached the
    feed: that chunk waits for the registry (restarted empty, given the record back by the
    owner's heartbeat) and is admitted; a record that never comes back is dropped after
    UNANSWERED_WAIT_S."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port, tmp_path)
    client = aioredis.from_url(url, socket_timeout=5)
    try:
        await eventually(lambda: probe_redis(url), 10, "redis-server up")
        registry = Registry(client, "t")
        await registry.create_session("s", "a fox", 1)
        feed = Owners(registry, "s")
        await feed.load()
        epoch = (await registry.claim("s", "wa", 0)).epoch
        server.kill()
        server.wait(timeout=10)
        admitted = asyncio.create_task(feed.admits("wa", epoch, history=False))
        await asyncio.sleep(1.5)
        assert not admitted.done()  # held, not dropped
        server = start_redis(port, tmp_path)
        await eventually(lambda: probe_redis(url), 10, "redis-server up again")
        await asyncio.sleep(0.5)
        assert not admitted.done()  # restarted empty: still no answer
        written = await registry.reannounce_session(
            "s",
            owner="wa",
            epoch=epoch,
            state=SessionState.EXECUTING,
            prompt="a fox",
            seed=1,
            last_seq=3,
        )
        assert written
        assert await asyncio.wait_for(admitted, 10)
        # A session the registry never hears of again: dropped once the wait is spent.
        monkeypatch.setattr(owners_module, "UNANSWERED_WAIT_S", 1.0)
        gone = Owners(registry, "never")
        started = time.monotonic()
        assert not await gone.admits("wa", 1, history=False)
        assert 0.5 < time.monotonic() - started < 5.0
    finally:
        await client.aclose()
        server.kill()
        server.wait(timeout=10)

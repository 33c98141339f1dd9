"""Lifetimes across replicas: idle without viewers, active again when one attaches, closed when
abandoned; the reaper runs on every replica and acts once."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from services.gateway import lifetimes
from services.gateway.store import Activity
from shared.states import SessionState
from tests.eventually import eventually
from tests.gateway.conftest import bearer, create, read_sse, run_gateway

pytestmark = pytest.mark.integration


async def kinds_seen(sub, n: int, within_s: float = 5.0) -> list[str]:
    out: list[str] = []
    deadline = time.monotonic() + within_s
    while len(out) < n and time.monotonic() < deadline:
        try:
            msg = await sub.next_msg(timeout=max(0.05, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - nats timeout
            break
        out.append(orjson.loads(msg.data)["kind"])
    return out


async def test_reaper_idles_then_closes_an_unwatched_session(http, gw, nats_client):
    g = gw.gateway
    events = await nats_client.subscribe(g.ctx.subjects.session_events)
    s = await create(http)
    sid = s["id"]
    t0 = time.time()
    idle_at = t0 + g.settings.idle_after_s + 1
    close_at = idle_at + g.settings.close_after_s
    assert await lifetimes.reap_once(g, now=t0) == {"idle": [], "closed": []}
    assert await lifetimes.reap_once(g, now=idle_at) == {"idle": [sid], "closed": []}
    assert await g.store.activity(sid) is Activity.IDLE
    assert await lifetimes.reap_once(g, now=idle_at + 1) == {"idle": [], "closed": []}  # once
    assert await lifetimes.reap_once(g, now=close_at) == {"idle": [], "closed": [sid]}
    record = await g.ctx.registry.get_session(sid)
    assert record.state is SessionState.TERMINATED
    assert await lifetimes.reap_once(g, now=close_at + 1) == {"idle": [], "closed": []}
    assert await kinds_seen(events, 3) == ["created", "idle", "closed"]


async def test_an_attached_viewer_keeps_a_session_active_and_brings_an_idle_one_back(
    gw_env, nats_client, redis_client
):
    # The clock is simulated ahead of the attachment refreshes: the TTL covers the jump.
    async with (
        run_gateway(gw_env, idle_after_s=2.0, close_after_s=3.0, attach_ttl_s=60.0) as gw,
        aiohttp.ClientSession(gw.url) as http,
    ):
        g = gw.gateway
        s = await create(http)
        sid = s["id"]
        events = await nats_client.subscribe(g.ctx.subjects.session_events)
        async with http.get(s["stream_url"], headers=bearer(s["token"])):
            await eventually(lambda: g.store.viewers(sid))
            # watched: neither idle nor closed, however late it is
            assert await lifetimes.reap_once(g, now=time.time() + 10) == {"idle": [], "closed": []}
        await eventually(lambda: _no_viewers(g, sid))
        assert await lifetimes.reap_once(g, now=time.time() + 2.5) == {"idle": [sid], "closed": []}
        async with http.get(s["stream_url"], headers=bearer(s["token"])):
            await eventually(lambda: _is(g, sid, Activity.ACTIVE))
            assert await kinds_seen(events, 2) == ["idle", "active"]
            assert await lifetimes.reap_once(g, now=time.time() + 10) == {"idle": [], "closed": []}


async def _no_viewers(g, sid) -> bool:
    return await g.store.viewers(sid) == 0


async def _is(g, sid, activity) -> bool:
    return await g.store.activity(sid) is activity


async def test_a_paused_session_stays_paused_when_a_viewer_attaches(http, gw):
    g = gw.gateway
    s = await create(http)
    await g.store.flip(s["id"], (Activity.ACTIVE,), Activity.PAUSED)
    async with http.get(s["stream_url"], headers=bearer(s["token"])):
        await eventually(lambda: g.store.viewers(s["id"]))
        assert await g.store.activity(s["id"]) is Activity.PAUSED


async def test_lifetimes_on_the_clock_with_two_replicas(gw_env, nats_client, redis_client, worker):
    """Short lifetimes, the reaper running for real on two replicas: a viewer on one keeps the
    session alive for both; once it leaves, the session goes idle and closes exactly once."""
    settings = {
        "idle_after_s": 1.0,
        "close_after_s": 1.5,
        "attach_ttl_s": 1.5,
        "reap_interval_s": 0.2,
    }
    events = await nats_client.subscribe(f"{gw_env['TURBOSERVE_SUBJECT_PREFIX']}.session.events")
    async with (
        run_gateway(gw_env, **settings) as a,
        run_gateway(gw_env, **settings) as b,
        aiohttp.ClientSession() as client,
    ):
        resp = await client.post(
            f"{a.url}/v1/sessions", json={"prompt": "p"}, headers=bearer("k-test-0123456789abcdef")
        )
        s = await resp.json()
        sid = s["id"]
        async with client.get(
            f"{b.url}/v1/sessions/{sid}/stream", headers=bearer(s["token"])
        ) as stream:
            await asyncio.sleep(
                3.5
            )  # the wait is the test: past idle_after_s + close_after_s and the TTL
            assert await a.store.activity(sid) is Activity.ACTIVE
            await worker.chunk(sid, 0)
            assert (await read_sse(stream, want=1))[0]["id"] == "0"
        await eventually(lambda: _is(a.gateway, sid, Activity.IDLE), timeout=5)
        await eventually(lambda: _terminated(a, sid), timeout=6)
        await asyncio.sleep(0.6)  # both reapers pass again: nothing more happens
    kinds = await kinds_seen(events, 10, within_s=1.0)
    assert kinds == ["created", "idle", "closed"]


async def _terminated(g, sid) -> bool:
    record = await g.ctx.registry.get_session(sid)
    return record is not None and record.state is SessionState.TERMINATED


async def test_a_dead_replicas_viewers_expire(gw, http):
    """A viewer counts while its replica says it is alive; once that lapses, the session's
    unwatched time starts when the replica was last alive (not when the reaper finds out), so
    a session watched through a replica that died long ago goes idle at once."""
    g = gw.gateway
    s = await create(http)
    sid = s["id"]
    now = time.time()
    await g.store.replica_alive("dead-replica", ttl_s=2.0, now=now)
    await g.store.attach(sid, "a1", "dead-replica", now=now)
    assert await g.store.viewers(sid, now=now + 1) == 1
    assert not await g.store.go_idle_if_unwatched(sid, now=now + 1)
    assert await g.store.viewers(sid, now=now + 3) == 0
    later = now + 3 + g.settings.idle_after_s
    assert not await g.store.go_idle_if_unwatched(sid, now=later)  # found dead: the clock moves
    [(found, seen)] = await g.store.unwatched_since(later - g.settings.idle_after_s)
    assert found == sid and seen == pytest.approx(now + 2.0)  # when the replica was last alive
    assert await g.store.go_idle_if_unwatched(sid, now=later)


async def test_a_stopped_replicas_viewers_were_watched_until_it_stopped(gw, http):
    """A replica that stops (a run of `turboserve up` that ends) says when: a later run's
    reaper counts its sessions unwatched from then, not from when it finds them."""
    g = gw.gateway
    sid = (await create(http))["id"]
    now = time.time()
    await g.store.replica_alive("earlier-run", ttl_s=15.0, now=now - 700)
    await g.store.attach(sid, "a1", "earlier-run", now=now - 700)
    await g.store.replica_gone("earlier-run", now=now - 690)
    assert await g.store.settle(sid, now=now) == (0, pytest.approx(now - 690))
    close_before = now - g.settings.idle_after_s - g.settings.close_after_s
    assert await g.store.claim_close(sid, close_before, now=now)


async def test_a_stopping_replica_takes_its_viewers_with_it(gw_env, nats_client, redis_client, gw):
    async with run_gateway(gw_env) as other, aiohttp.ClientSession() as client:
        resp = await client.post(
            f"{gw.url}/v1/sessions", json={"prompt": "p"}, headers=bearer("k-test-0123456789abcdef")
        )
        s = await resp.json()
        async with client.get(
            f"{other.url}/v1/sessions/{s['id']}/stream", headers=bearer(s["token"])
        ):
            await eventually(lambda: gw.store.viewers(s["id"]))
            await other.service.stop()
            assert await gw.store.viewers(s["id"]) == 0

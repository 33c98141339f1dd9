"""Gateway and scheduler running in-process against the real NATS and Redis.

A test client plays the worker: it registers in the registry and listens on its command subject,
so each hop is checked on the wire: the gateway's event is decoded by the scheduler, whose
command is decoded here.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from services.gateway.service import GatewayService
from services.scheduler.service import SchedulerService
from shared.registry import WorkerRecord
from shared.runner import running, subscriptions_live
from shared.settings import GatewaySettings, SchedulerSettings
from shared.wire import (
    SessionEvent,
    SessionEventKind,
    WorkerCmdKind,
    WorkerCommand,
    WorkerStatus,
    decode,
    encode,
)
from tools.servers import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def env(infra, isolation, nats_client):  # nats_client: deletes the test's streams after it
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
    }


@contextlib.asynccontextmanager
async def mesh_core(env):
    port = free_port()
    gw_settings = GatewaySettings.from_env(env, port=port)
    # Test "workers" are registry entries that never heartbeat: keep them for the whole test.
    sch_settings = SchedulerSettings.from_env(env, tick_s=0.2, worker_timeout_s=60.0)
    async with (
        running(SchedulerService(sch_settings), sch_settings) as sch_ctx,
        running(GatewayService(gw_settings), gw_settings),
    ):
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield http, sch_ctx


class _Answering:
    """A subscription on a worker's command subject that answers every command the way a
    worker does (accepted), so the scheduler does not send it again."""

    def __init__(self, sub) -> None:
        self.sub = sub

    async def next_msg(self, timeout: float):
        from shared.wire import CommandReply

        msg = await self.sub.next_msg(timeout=timeout)
        if msg.reply:
            cmd = decode(msg.subject, msg.data, WorkerCommand)
            await msg.respond(
                encode(CommandReply(worker_id=cmd.worker_id, ok=True, command_id=cmd.command_id))
            )
        return msg


async def _worker_sub(nats_client, subject: str) -> _Answering:
    sub = await nats_client.subscribe(subject)
    await subscriptions_live(nats_client)
    return _Answering(sub)


async def _next_command(sub, timeout=10.0) -> WorkerCommand:
    msg = await sub.next_msg(timeout=timeout)
    return decode(msg.subject, msg.data, WorkerCommand)


async def test_session_event_reaches_scheduler_and_worker_command_is_decoded(
    env, nats_client, redis_client
):
    async with mesh_core(env) as (http, ctx):
        worker = WorkerRecord(id="wtest", status=WorkerStatus.READY, capacity=4)
        await ctx.registry.register_worker(worker, ttl_s=60)
        sub = await _worker_sub(nats_client, ctx.subjects.worker_cmd("wtest"))

        resp = await http.post("/v1/sessions", json={"prompt": "a lighthouse at dusk", "seed": 5})
        assert resp.status == 201
        body = await resp.json()
        assert body["stream_url"].endswith(f"/v1/sessions/{body['id']}/stream")

        cmd = await _next_command(sub)
        assert cmd.kind is WorkerCmdKind.ASSIGN and cmd.session_id == body["id"]
        assert cmd.prompt == "a lighthouse at dusk" and cmd.seed == 5 and cmd.seq == 0
        record = await ctx.registry.get_session(body["id"])
        assert record.owner == "wtest" and record.epoch == cmd.epoch == 1
        assert (await ctx.registry.placement())[body["id"]] == "wtest"

        resp = await http.delete(
            f"/v1/sessions/{body['id']}", headers={"Authorization": f"Bearer {body['token']}"}
        )
        assert resp.status == 200 and (await resp.json())["state"] == "terminated"
        stop = await _next_command(sub)
        assert stop.kind is WorkerCmdKind.STOP and stop.session_id == body["id"]


async def test_garbage_on_subjects_is_dropped_and_service_keeps_serving(env, nats_client):
    async with mesh_core(env) as (http, ctx):
        js = nats_client.jetstream()
        for junk in (
            b"\x00\xffgarbage",
            b"{}",
            b'{"type":"session_event","session_id":"x y","kind":"created"}',
        ):
            await js.publish(ctx.subjects.session_events, junk)
        await nats_client.publish(ctx.subjects.provisioner_cmd, b"nonsense")
        # A valid event after the garbage is still handled: the scheduler places the session.
        await ctx.registry.register_worker(
            WorkerRecord(id="wg", status=WorkerStatus.READY, capacity=2), 60
        )
        sub = await _worker_sub(nats_client, ctx.subjects.worker_cmd("wg"))
        resp = await http.post("/v1/sessions", json={"prompt": "after garbage"})
        assert resp.status == 201
        cmd = await _next_command(sub)
        assert cmd.session_id == (await resp.json())["id"]
        assert (await http.get("/healthz")).status == 200


async def test_pending_session_placed_when_a_worker_appears(env, nats_client):
    """The event arrives before any worker exists; the tick places it later."""
    async with mesh_core(env) as (http, ctx):
        resp = await http.post("/v1/sessions", json={"prompt": "waiting"})
        sid = (await resp.json())["id"]
        assert (await ctx.registry.get_session(sid)).state.value == "pending"
        sub = await _worker_sub(nats_client, ctx.subjects.worker_cmd("late"))
        await ctx.registry.register_worker(
            WorkerRecord(id="late", status=WorkerStatus.READY, capacity=1), 60
        )
        cmd = await _next_command(sub)
        assert cmd.session_id == sid


async def test_dead_worker_sessions_are_requeued_and_continue_at_next_seq(env, nats_client):
    async with mesh_core(env) as (http, ctx):
        await ctx.registry.register_worker(
            WorkerRecord(id="dies", status=WorkerStatus.READY, capacity=4), 60
        )
        sub_dead = await _worker_sub(nats_client, ctx.subjects.worker_cmd("dies"))
        sid = (await (await http.post("/v1/sessions", json={"prompt": "p"})).json())["id"]
        first = await _next_command(sub_dead)
        assert await ctx.registry.record_progress(sid, "dies", first.epoch, 4)
        # "dies" stops heartbeating (its liveness key expires); a healthy worker takes over at seq 5
        await ctx.redis.delete(ctx.registry.alive_key("dies"))
        sub_new = await _worker_sub(nats_client, ctx.subjects.worker_cmd("heir"))
        await ctx.registry.register_worker(
            WorkerRecord(id="heir", status=WorkerStatus.READY, capacity=4), 60
        )
        cmd = await _next_command(sub_new)
        assert cmd.session_id == sid and cmd.seq == 5 and cmd.epoch > first.epoch
        assert not await ctx.registry.record_progress(sid, "dies", first.epoch, 5)


async def test_worker_alive_without_its_session_gets_it_requeued(env, nats_client):
    """A lost ASSIGN: the worker heartbeats but never lists the session; it goes elsewhere."""
    from shared.wire import Heartbeat

    async with mesh_core(env) as (http, ctx):
        await ctx.registry.register_worker(
            WorkerRecord(id="deaf", status=WorkerStatus.READY, capacity=1), 60
        )
        sub_deaf = await _worker_sub(nats_client, ctx.subjects.worker_cmd("deaf"))
        sid = (await (await http.post("/v1/sessions", json={"prompt": "p"})).json())["id"]
        first = await _next_command(sub_deaf)
        # "deaf" keeps beating without the session, long after the assignment
        await ctx.registry.set_worker_status("deaf", WorkerStatus.DRAINING)  # take no more
        record = await ctx.registry.get_session(sid)
        beat = Heartbeat(
            worker_id="deaf",
            status=WorkerStatus.DRAINING,
            capacity=1,
            active=0,
            sessions=[],
            at=record.updated_at + 120,
        )
        sub_new = await _worker_sub(nats_client, ctx.subjects.worker_cmd("good"))
        await ctx.registry.register_worker(
            WorkerRecord(id="good", status=WorkerStatus.READY, capacity=2), 60
        )
        await nats_client.publish(ctx.subjects.worker_heartbeat(beat.worker_id), encode(beat))
        cmd = await _next_command(sub_new)
        assert cmd.session_id == sid and cmd.epoch > first.epoch


async def test_scheduler_decodes_events_published_by_another_client(env, nats_client):
    async with mesh_core(env) as (http, ctx):
        await ctx.registry.create_session("extern1", "p", 1)
        await ctx.registry.register_worker(
            WorkerRecord(id="wx", status=WorkerStatus.READY, capacity=1), 60
        )
        sub = await _worker_sub(nats_client, ctx.subjects.worker_cmd("wx"))
        ev = SessionEvent(session_id="extern1", kind=SessionEventKind.CREATED)
        await nats_client.jetstream().publish(ctx.subjects.session_events, encode(ev))
        cmd = await _next_command(sub)
        assert cmd.session_id == "extern1"
        # nothing else to place: no spurious second command
        with pytest.raises(asyncio.TimeoutError):
            await sub.next_msg(timeout=0.6)


async def test_concurrent_deletes_are_idempotent(env, nats_client):
    async with mesh_core(env) as (http, ctx):
        created = await (await http.post("/v1/sessions", json={"prompt": "p"})).json()
        sid, auth = created["id"], {"Authorization": f"Bearer {created['token']}"}
        responses = await asyncio.gather(
            *(http.delete(f"/v1/sessions/{sid}", headers=auth) for _ in range(4))
        )
        assert [r.status for r in responses] == [200] * 4
        bodies = [await r.json() for r in responses]
        assert {b["state"] for b in bodies} == {"terminated"}
        assert (await ctx.registry.get_session(sid)).epoch == 1  # terminated exactly once


async def test_stream_of_terminated_session_ends_without_stream_end_message(env, nats_client):
    """The StreamEnd can be gone (retention) or never sent: the registry ends the stream."""
    from shared.states import SessionState

    async with mesh_core(env) as (http, ctx):
        from services.gateway.auth import digest

        rec = await ctx.registry.create_session("gone1", "p", 0, token_hash=digest("t0ken"))
        rec = await ctx.registry.claim("gone1", "wz", rec.epoch)
        await ctx.registry.record_progress("gone1", "wz", rec.epoch, 3)
        await ctx.registry.transition("gone1", SessionState.TERMINATED)
        async with http.get(
            "/v1/sessions/gone1/stream", headers={"Authorization": "Bearer t0ken"}
        ) as resp:
            async with asyncio.timeout(15):
                text = (await resp.read()).decode()
        assert "event: end" in text and '"reason":"closed"' in text


def test_service_gives_up_connecting_with_exit_code_2(tmp_path):
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "TURBOSERVE_NATS_URL": "nats://127.0.0.1:1",
        "TURBOSERVE_CONNECT_TIMEOUT_S": "1.5",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "scheduler"], env=env, capture_output=True, timeout=60
    )
    assert proc.returncode == 2
    assert b"startup_failed" in proc.stderr


def test_sigterm_while_connecting_exits_0():
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {
        **os.environ,
        "TURBOSERVE_NATS_URL": "nats://127.0.0.1:1",
        "TURBOSERVE_CONNECT_TIMEOUT_S": "300",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "scheduler"], env=env, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    line = b""
    while b"connect_retry" not in line:  # it is in its retry loop
        line = proc.stderr.readline()
        assert line and time.monotonic() < deadline
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    proc.stderr.close()

"""Active/standby schedulers: the lease in Redis, a standby taking over from a killed leader,
and a deposed leader whose writes and commands nobody accepts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from shared.leader import LeaderElection
from shared.registry import GuardFailed, Registry
from shared.states import SessionState
from shared.wire import (
    CommandReply,
    SessionEvent,
    SessionEventKind,
    WorkerCmdKind,
    WorkerCommand,
    decode,
    encode,
)
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context, worker_processes
from tools.servers import free_port

pytestmark = pytest.mark.integration


async def test_the_lease_has_one_holder_a_term_per_leadership_and_guards_writes(
    redis_client, isolation
):
    ns = isolation["TURBOSERVE_REDIS_NAMESPACE"]
    a = LeaderElection(redis_client, ns, "a", ttl_s=0.5)
    b = LeaderElection(redis_client, ns, "b", ttl_s=0.5)
    lease_a = await a.try_acquire()
    assert lease_a is not None and lease_a.term >= 1
    assert await b.try_acquire() is None
    assert await a.renew(lease_a) and await b.current_term() == lease_a.term
    registry = Registry(redis_client, ns)
    record = await registry.create_session("s", "p", 0)
    record = await registry.claim("s", "w", record.epoch, guard=lease_a.guard)
    await asyncio.sleep(0.7)  # a stops renewing: the lease expires
    lease_b = await b.try_acquire()
    assert lease_b is not None and lease_b.term > lease_a.term
    assert not await a.renew(lease_a)  # deposed
    with pytest.raises(GuardFailed):  # a deposed leader changes no ownership
        await registry.transition(
            "s", SessionState.PENDING, expected_epoch=record.epoch, owner=None, guard=lease_a.guard
        )
    assert (await registry.get_session("s")).owner == "w"
    await b.resign(lease_b)
    assert await a.current_term() is None
    # Redis restarted empty: the counter is gone, yet no term is handed out twice.
    await redis_client.delete(a.key, a.term_key)
    lease_c = await a.try_acquire()
    assert lease_c is not None and lease_c.term > lease_b.term


@pytest.mark.slow
async def test_a_standby_takes_over_from_a_killed_leader_and_the_old_term_is_refused(env):
    procs: list[subprocess.Popen[bytes]] = []

    def scheduler(sid: str, ops_port: int = -1) -> subprocess.Popen[bytes]:
        penv = {
            **os.environ,
            **env,
            "TURBOSERVE_SCHEDULER_ID": sid,
            "TURBOSERVE_LEADER_TTL_S": "1.5",
            "TURBOSERVE_TICK_S": "0.25",
            "TURBOSERVE_METRICS_PORT": str(ops_port),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "scheduler"], env=penv, stdin=subprocess.DEVNULL
        )
        procs.append(proc)
        return proc

    try:
        async with (
            mesh_context(env) as (ctx, rx),
            worker_processes(ctx, env, ["w1"], chunk_period_s=0.25),
        ):
            first = scheduler("first")
            await eventually(lambda: _status(ctx), 30, "a leader")
            status = await ctx.registry.scheduler_status()
            assert status["leader"] == "first"
            old_term = status["term"]
            standby_port = free_port()
            scheduler("second", ops_port=standby_port)
            # Its ops endpoint opens once it is connected, just before it tries the lease.
            await eventually(lambda: _answers(standby_port), 30, "the standby up and waiting")
            await start_session_via_events(ctx, "s")
            await eventually(lambda: len(rx.chunks["s"]) >= 3, 30, "chunks under the first leader")
            first.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            await eventually(lambda: _leader_is(ctx, "second"), 30, "the standby")
            took_over_s = time.monotonic() - killed_at
            assert took_over_s < 10, took_over_s
            count = len(rx.chunks["s"])
            await eventually(lambda: len(rx.chunks["s"]) >= count + 4, 30, "chunks after")
            # The standby placed what arrives now.
            await start_session_via_events(ctx, "t")
            await eventually(lambda: len(rx.chunks["t"]) >= 2, 30, "a new session's chunks")
            # A command under the dead leader's term is refused by the worker.
            record = await ctx.registry.get_session("s")
            stale = WorkerCommand(
                kind=WorkerCmdKind.SUSPEND,
                worker_id="w1",
                session_id="s",
                epoch=record.epoch,
                term=old_term,
                command_id="old",
            )
            reply = decode(
                "r",
                (
                    await ctx.nc.request(ctx.subjects.worker_cmd("w1"), encode(stale), timeout=5)
                ).data,
                CommandReply,
            )
            assert not reply.ok and reply.code == "stale_leader"
            seqs = rx.seqs("s")
            assert seqs == list(range(len(seqs)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            await asyncio.to_thread(proc.wait, 30)


async def _answers(port: int) -> bool:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/healthz") as resp,
        ):
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def _status(ctx) -> bool:
    return await ctx.registry.scheduler_status() is not None


async def _leader_is(ctx, sid: str) -> bool:
    status = await ctx.registry.scheduler_status()
    return status is not None and status.get("leader") == sid


async def start_session_via_events(ctx, sid: str) -> None:
    """As the gateway does: the session in the registry, then the event."""
    await ctx.registry.create_session(sid, "p", 2)
    await ctx.js.publish(
        ctx.subjects.session_events,
        encode(SessionEvent(session_id=sid, kind=SessionEventKind.CREATED)),
    )

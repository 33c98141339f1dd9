"""A worker killed with SIGKILL mid-stream: its sessions continue on another worker from the
next seq, rebuilt from their recovery logs (the frames are those of the same session with no
failure), or, with the log switched off, restart from their prompt and say so."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.scheduler.service import SchedulerService
from shared.runner import running
from shared.settings import SchedulerSettings
from shared.wire import NoticeKind, SessionEvent, SessionEventKind, encode
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import Received, mesh_context, worker_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PERIOD = 0.25


@pytest.fixture
def env(infra, isolation, nats_client, redis_client):
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_METRICS_PORT": "-1",
        **isolation,
    }


async def create(ctx, sid: str, prompt: str, seed: int) -> None:
    await ctx.registry.create_session(sid, prompt, seed)
    await ctx.js.publish(
        ctx.subjects.session_events,
        encode(SessionEvent(session_id=sid, kind=SessionEventKind.CREATED)),
    )


def by_seq(rx: Received, sid: str) -> dict[int, list]:
    """Every chunk published for ``sid``, by seq (a chunk published just before a crash may be
    made again by the next owner: viewers keep the first; it must be the same chunk)."""
    out: dict[int, list] = {}
    for _, chunk in rx.chunks[sid]:
        out.setdefault(chunk.seq, []).append(chunk)
    return out


async def run_crash(env, recovery: bool) -> tuple[Received, float, str, str]:
    settings = SchedulerSettings.from_env(
        env, tick_s=0.25, worker_timeout_s=3.0, min_workers=2, max_workers=2
    )
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(
            ctx, env, ["wa", "wb"], chunk_period_s=PERIOD, recovery_log=str(recovery).lower()
        ) as procs,
        running(SchedulerService(settings), settings),
    ):
        await create(ctx, "s", "a paper boat on a river", 7)
        await eventually(lambda: len(rx.chunks["s"]) >= 8, 30, "chunks before the crash")
        victim = rx.chunks["s"][-1][1].worker_id
        survivor = "wb" if victim == "wa" else "wa"
        os.kill(procs[victim].pid, signal.SIGKILL)
        await asyncio.to_thread(procs[victim].wait)
        last_before = rx.chunks["s"][-1][0]
        await eventually(
            lambda: rx.chunks["s"][-1][1].worker_id == survivor,
            30,
            "the session on the other worker",
        )
        first_after = next(t for t, c in rx.chunks["s"] if c.worker_id == survivor)
        count = len(rx.chunks["s"])
        await eventually(lambda: len(rx.chunks["s"]) >= count + 6, 30, "chunks after")
        return rx, first_after - last_before, victim, survivor


async def test_a_killed_workers_session_continues_exactly_on_another(env):
    rx, stall_s, victim, survivor = await run_crash(env, recovery=True)
    chunks = by_seq(rx, "s")
    seqs = sorted(chunks)
    assert seqs == list(range(len(seqs))), seqs  # no seq missing
    for seq, copies in chunks.items():
        assert all(c.fmp4 == copies[0].fmp4 for c in copies), f"seq {seq} made twice, differently"
    kinds = [n.kind for n in rx.notices["s"]]
    assert kinds[0] is NoticeKind.PLACED and NoticeKind.RECOVERED in kinds
    assert NoticeKind.RESTARTED not in kinds
    recovered = next(n for n in rx.notices["s"] if n.kind is NoticeKind.RECOVERED)
    assert recovered.worker_id == survivor and recovered.next_seq in chunks
    print(f"stream stalled {stall_s:.2f}s across the crash of {victim}")  # reported by -s
    # The frames are those of the same session with no failure (the default weights rebuild
    # bitwise; docs/worker.md gives the tolerance for other weights).
    return_frames = {seq: copies[0].fmp4 for seq, copies in chunks.items()}
    reference = await reference_frames(env, len(return_frames))
    for seq in sorted(reference):
        assert return_frames[seq] == reference[seq], f"chunk {seq} differs from the no-failure run"


async def reference_frames(env, count: int) -> dict[int, bytes]:
    """The same session (prompt, seed) generated with no failure, alone on one worker."""
    ref_env = {
        **env,
        "TURBOSERVE_SUBJECT_PREFIX": env["TURBOSERVE_SUBJECT_PREFIX"] + "r",
        "TURBOSERVE_REDIS_NAMESPACE": env["TURBOSERVE_REDIS_NAMESPACE"] + "r",
    }
    settings = SchedulerSettings.from_env(ref_env, tick_s=0.25, min_workers=1, max_workers=1)
    async with (
        mesh_context(ref_env) as (ctx, rx),
        worker_processes(ctx, ref_env, ["wr"], chunk_period_s=PERIOD),
        running(SchedulerService(settings), settings),
    ):
        await create(ctx, "s", "a paper boat on a river", 7)
        await eventually(lambda: len(rx.chunks["s"]) >= count, 60, "reference chunks")
        out = {c.seq: c.fmp4 for _, c in rx.chunks["s"][:count]}
        keys = [k async for k in ctx.redis.scan_iter(match=f"{ctx.registry.ns}:*")]
        if keys:
            await ctx.redis.delete(*keys)
        for stream in (ctx.subjects.sessions_stream, ctx.subjects.chunks_stream):
            await ctx.js.delete_stream(stream)
    return out


async def test_without_the_log_the_session_restarts_and_says_so(env):
    rx, _, _, survivor = await run_crash(env, recovery=False)
    chunks = by_seq(rx, "s")
    seqs = sorted(chunks)
    assert seqs == list(range(len(seqs)))  # the seqs still continue: nothing is skipped
    restarted = [n for n in rx.notices["s"] if n.kind is NoticeKind.RESTARTED]
    assert restarted and restarted[0].worker_id == survivor
    assert restarted[0].next_seq in chunks  # it said so before its first chunk there

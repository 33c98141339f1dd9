"""Redis under a running worker, on a Redis of the test's own: restarted empty, the worker
re-announces the sessions it generates and they never stop streaming; paused, chunks keep
coming while every Redis command waits."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from shared.states import SessionState
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import start_session, worker_in_process
from tests.server_group import start_redis
from tools.servers import free_port, probe_redis

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_sessions_survive_redis_restarting_empty(infra, isolation, nats_client, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis = start_redis(port, tmp_path)
    try:
        await eventually(lambda: probe_redis(url), 10, "redis-server up")
        env = {
            "TURBOSERVE_NATS_URL": infra.nats_url,
            "TURBOSERVE_REDIS_URL": url,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_METRICS_PORT": "-1",
            **isolation,
        }
        async with worker_in_process(env, worker_id="w1", chunk_period_s=0.25) as (svc, ctx, rx):
            for sid in ("a", "b"):
                await start_session(ctx, "w1", sid, token_hash=f"digest-of-{sid}")
            await eventually(
                lambda: len(rx.chunks["a"]) >= 3 and len(rx.chunks["b"]) >= 3, 30, "chunks"
            )
            before = {sid: await ctx.registry.get_session(sid) for sid in ("a", "b")}
            redis.terminate()
            await asyncio.to_thread(redis.wait)
            redis = start_redis(port, tmp_path)  # empty: no persistence
            await eventually(lambda: probe_redis(url), 10, "redis-server up")

            async def reannounced() -> dict[str, Any]:  # within a heartbeat or two
                records = {sid: await _get(ctx, sid) for sid in ("a", "b")}
                return records if all(records.values()) else {}

            records = await eventually(reannounced, 20, "both sessions re-announced")
            for sid, record in records.items():
                assert record is not None, f"{sid} was not re-announced"
                assert record.owner == "w1" and record.state is SessionState.EXECUTING
                assert record.epoch == before[sid].epoch and record.prompt == before[sid].prompt
                assert record.token_hash == f"digest-of-{sid}"  # its viewer's token still opens it
            assert (await ctx.registry.placement()) == {"a": "w1", "b": "w1"}
            counts = {sid: len(rx.chunks[sid]) for sid in ("a", "b")}
            await eventually(
                lambda: all(len(rx.chunks[s]) >= counts[s] + 4 for s in counts),
                30,
                "chunks after the restart",
            )
            for sid in ("a", "b"):
                seqs = rx.seqs(sid)
                assert sorted(set(seqs)) == list(range(max(seqs) + 1)), seqs

            async def recorded() -> bool:
                # Through _get: a pooled connection from before the restart fails once.
                records = [await _get(ctx, sid) for sid in counts]
                return all(r is not None and r.last_seq >= counts[r.id] - 1 for r in records)

            await eventually(recorded, 10, "progress recorded after the restart")
            assert any(w.id == "w1" for w in await ctx.registry.workers())
    finally:
        redis.terminate()
        redis.wait()


async def _get(ctx, sid):
    try:
        return await ctx.registry.get_session(sid)
    except Exception:  # noqa: BLE001 - Redis still coming back
        return None


async def test_chunks_keep_coming_while_redis_is_paused(infra, isolation, nats_client, tmp_path):
    """``CLIENT PAUSE 3000 ALL`` stalls every Redis command for 3 s, the worker's progress
    records included. The generation thread never waits on them, and chunks are published
    apart from their records: both sessions' chunks keep arriving during the pause, and their
    records catch up after it."""
    import redis.asyncio as aioredis

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis = start_redis(port, tmp_path)  # paused below: never the Redis other tests share
    try:
        await eventually(lambda: probe_redis(url), 10, "redis-server up")
        env = {
            "TURBOSERVE_NATS_URL": infra.nats_url,
            "TURBOSERVE_REDIS_URL": url,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_METRICS_PORT": "-1",
            **isolation,
        }
        admin = aioredis.from_url(url)
        async with worker_in_process(env, worker_id="w1", chunk_period_s=0.25) as (svc, ctx, rx):
            sids = ("a", "b")
            for sid in sids:
                await start_session(ctx, "w1", sid)
            await eventually(lambda: all(len(rx.chunks[s]) >= 3 for s in sids), 30, "chunks")
            await admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")
            paused_at = time.time()

            async def read_answered_at() -> float:
                await ctx.registry.get_session("a")
                return time.time()

            probe = asyncio.create_task(read_answered_at())
            await asyncio.sleep(3.0)  # the pause itself is what this test waits through
            # The pause was real: a registry read issued at its start waited most of it.
            assert await probe - paused_at >= 2.5
            # Chunks already on their way when it began are not counted: from 0.5 s in.
            window = (paused_at + 0.5, paused_at + 2.8)
            during = {
                sid: [c.seq for at, c in rx.chunks[sid] if window[0] <= at <= window[1]]
                for sid in sids
            }
            # 2.3 s at one chunk per 0.25 s is 9 chunks a session; a worker that waits on
            # Redis gets none out.
            assert all(len(seqs) >= 4 for seqs in during.values()), during
            last = {sid: rx.seqs(sid)[-1] for sid in sids}
            for sid in sids:
                seqs = rx.seqs(sid)
                assert sorted(set(seqs)) == list(range(max(seqs) + 1)), seqs

            async def caught_up() -> bool:  # the records catch up once Redis answers again
                records = {sid: await ctx.registry.get_session(sid) for sid in sids}
                for sid, record in records.items():
                    assert record is not None and record.owner == "w1"
                    assert record.last_seq >= last[sid], (sid, record.last_seq, last[sid])
                return True

            await eventually(caught_up, 10, "the records caught up")
        await admin.aclose()
    finally:
        redis.terminate()
        redis.wait()

"""Sessions still waiting for a worker when Redis lost them (restarted empty): the scheduler
kept their records and writes them back as pending, and they are placed and stream."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

from services.scheduler.unplaced import Unplaced
from shared.registry import Registry
from shared.states import SessionState
from shared.wire import SessionEvent, SessionEventKind, encode
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context, worker_processes
from tests.server_group import start_redis
from tools.servers import free_port, probe_redis

pytestmark = pytest.mark.integration


async def _empty(redis_client: Any, ns: str) -> None:
    """Every key of the namespace gone, as a Redis restarted empty has them."""
    keys = [k async for k in redis_client.scan_iter(match=f"{ns}:*", count=500)]
    if keys:
        await redis_client.delete(*keys)


async def test_kept_pending_records_are_written_back_and_nothing_else(redis_client, isolation):
    ns = isolation["TURBOSERVE_REDIS_NAMESPACE"]
    registry = Registry(redis_client, ns)
    waiting = await registry.create_session(
        "waiting", "a prompt", 7, token_hash="digest", owner_key="key-a", strength=None
    )
    running = await registry.create_session("running", "p", 1)
    await registry.claim("running", "w1", running.epoch)
    requeued = await registry.create_session("requeued", "p", 2)
    moved = await registry.claim("requeued", "w1", requeued.epoch)
    await registry.transition(
        "requeued", SessionState.PENDING, expected_epoch=moved.epoch, owner=None
    )
    unplaced = Unplaced()
    await unplaced.refresh(registry, await registry.pending_sessions())
    assert sorted(unplaced.records) == ["requeued", "waiting"]
    assert await unplaced.write_back(registry) == []  # nothing lost: nothing written

    await _empty(redis_client, ns)
    assert sorted(await unplaced.write_back(registry)) == ["requeued", "waiting"]
    back = await registry.get_session("waiting")
    assert back is not None and back.state is SessionState.PENDING and back.owner is None
    assert (back.epoch, back.prompt, back.seed) == (0, "a prompt", 7)
    assert (back.token_hash, back.owner_key) == ("digest", "key-a")  # its viewer's token opens it
    assert back.created_at == pytest.approx(waiting.created_at)
    assert (await registry.get_session("requeued")).epoch == moved.epoch + 1
    assert sorted(await registry.pending_sessions()) == ["requeued", "waiting"]
    assert await registry.get_session("running") is None  # its owner writes it back, not this

    # The registry's own state wins: a record there is never overwritten.
    claimed = await registry.claim("waiting", "w2", back.epoch)
    assert await unplaced.write_back(registry) == []
    assert (await registry.get_session("waiting")).owner == "w2" == claimed.owner
    # Placed or closed: dropped, never written back.
    unplaced.drop("waiting")
    await unplaced.refresh(registry, await registry.pending_sessions())
    assert sorted(unplaced.records) == ["requeued"]


@pytest.mark.slow
async def test_a_session_pending_when_redis_restarted_empty_is_placed_and_streams(
    infra, isolation, nats_client, tmp_path
):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis = start_redis(port, tmp_path)
    scheduler: subprocess.Popen[bytes] | None = None
    try:
        await eventually(lambda: probe_redis(url), 10, "redis-server up")
        env = {
            "TURBOSERVE_NATS_URL": infra.nats_url,
            "TURBOSERVE_REDIS_URL": url,
            "TURBOSERVE_LOG_LEVEL": "warning",
            **isolation,
        }
        async with mesh_context(env) as (ctx, rx):
            scheduler = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                [sys.executable, "-m", "tools.cli", "scheduler"],
                env={
                    **os.environ,
                    **env,
                    "TURBOSERVE_LEADER_TTL_S": "1.5",
                    "TURBOSERVE_TICK_S": "0.25",
                    "TURBOSERVE_METRICS_PORT": "-1",
                },
                stdin=subprocess.DEVNULL,
            )
            await eventually(lambda: _status(ctx), 30, "a leader")
            # No worker yet: the session waits, never placed.
            await ctx.registry.create_session("s", "p", 2, token_hash="digest-of-s")
            await ctx.js.publish(
                ctx.subjects.session_events,
                encode(SessionEvent(session_id="s", kind=SessionEventKind.CREATED)),
            )
            await eventually(lambda: _pending(ctx, 1), 30, "the scheduler holding it pending")

            redis.terminate()
            await asyncio.to_thread(redis.wait)
            redis = start_redis(port, tmp_path)  # empty: no persistence
            await eventually(lambda: probe_redis(url), 10, "redis-server up again")

            async def written_back() -> Any:
                record = await _get(ctx, "s")
                return record if record is not None else None

            record = await eventually(written_back, 30, "the pending session written back")
            assert record.state is SessionState.PENDING and record.owner is None
            assert record.token_hash == "digest-of-s" and record.seed == 2

            async with worker_processes(ctx, env, ["w1"], chunk_period_s=0.25):
                await eventually(lambda: len(rx.chunks["s"]) >= 3, 60, "its chunks")
                placed = await ctx.registry.get_session("s")
                assert placed is not None and placed.owner == "w1"
                assert placed.state is SessionState.EXECUTING
                seqs = rx.seqs("s")
                assert seqs == list(range(len(seqs))), seqs
    finally:
        if scheduler is not None:
            scheduler.terminate()
            await asyncio.to_thread(scheduler.wait, 30)
        redis.terminate()
        redis.wait()


async def _get(ctx: Any, sid: str) -> Any:
    try:
        return await ctx.registry.get_session(sid)
    except Exception:  # noqa: BLE001 - a pooled connection from before the restart fails once
        return None


async def _status(ctx: Any) -> bool:
    return await ctx.registry.scheduler_status() is not None


async def _pending(ctx: Any, count: int) -> bool:
    status = await ctx.registry.scheduler_status()
    return status is not None and status.get("pending") == count

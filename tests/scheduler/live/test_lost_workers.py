"""A worker the scheduler declares lost (silent past TURBOSERVE_WORKER_TIMEOUT_S) is shown as
``lost`` with no sessions in every view, then drops out of them; so does a dead worker's record
that no scheduler ever took into its pool."""

from __future__ import annotations

import asyncio

import pytest

from shared.registry import WorkerRecord
from shared.wire import WorkerStatus
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context
from tests.scheduler.live.scheduler_harness import leading
from tools.ctl import Ctl, format_status

pytestmark = pytest.mark.integration

SHOWN_S = 2.0


async def test_a_lost_worker_is_shown_lost_without_sessions_then_forgotten(env):
    settings = {"worker_timeout_s": 1.0, "lost_worker_shown_s": SHOWN_S}
    async with mesh_context(env) as (ctx, _), leading(ctx, env, settings=settings) as (live, _core):
        registry = ctx.registry
        sids = []
        for i in range(3):
            record = await registry.create_session(f"s{i}", "a fox", i)
            await registry.claim(record.id, "w-dead", record.epoch)
            sids.append(record.id)
        # One ready worker holding three sessions, one that died booting; neither beats again.
        await registry.register_worker(
            WorkerRecord("w-dead", WorkerStatus.READY, capacity=4, sessions=tuple(sids), active=3),
            ttl_s=0.6,
        )
        await registry.register_worker(
            WorkerRecord("w-ghost", WorkerStatus.BOOTING, capacity=4), ttl_s=0.6
        )
        await eventually(
            lambda: "w-dead" in live.pool.workers, 5, "the scheduler takes the worker in"
        )

        async def both_lost() -> bool:
            records = {w.id: w for w in await registry.workers()}
            return all(
                wid in records and records[wid].status is WorkerStatus.LOST
                for wid in ("w-dead", "w-ghost")
            )

        await eventually(both_lost, 8, "both workers shown lost")
        status = await Ctl(ctx).status()
        shown = {w["id"]: w for w in status["workers"]}
        for wid in ("w-dead", "w-ghost"):
            assert shown[wid]["status"] == "lost" and shown[wid]["sessions"] == []
            assert not shown[wid]["alive"]
        table = format_status(status)
        assert "(silent)" not in table and table.count(" lost ") == 2, table
        records = {w.id: w for w in await registry.workers()}
        assert records["w-dead"].sessions == () and records["w-dead"].active == 0
        assert "w-dead" not in (await registry.placement()).values()
        assert set(sids) <= set(await registry.pending_sessions())

        async def forgotten() -> bool:
            ids = {w.id for w in await registry.workers()}
            return not ids & {"w-dead", "w-ghost"}

        await eventually(forgotten, SHOWN_S + 4, "lost workers dropped from view")
        members = await ctx.redis.smembers(registry.workers_key)
        assert not {m.decode() for m in members} & {"w-dead", "w-ghost"}


async def test_a_worker_shown_lost_that_beats_again_is_kept(env):
    async with mesh_context(env) as (ctx, _):
        registry = ctx.registry
        worker = WorkerRecord("w-back", WorkerStatus.READY, capacity=4)
        await registry.register_worker(worker, ttl_s=5.0)
        assert await registry.mark_worker_lost("w-back", 0.3)
        assert not await registry.mark_worker_lost("w-never", 0.3)  # no record: nothing made
        await registry.register_worker(worker, ttl_s=5.0)  # it was only cut off
        await asyncio.sleep(0.6)
        records = {w.id: w for w in await registry.workers()}
        assert records["w-back"].status is WorkerStatus.READY and records["w-back"].alive
        assert "w-never" not in records

"""Live and simulated placement take the same path: a worker's heartbeat says when its pass in
flight ends, the live scheduler hands that to the policy (``note_pass``, as the simulator does),
and a session that becomes active goes where its first chunk comes soonest."""

from __future__ import annotations

import time

import pytest

from services.scheduler.core.types import Event, EventKind
from shared.registry import WorkerRecord
from shared.wire import Heartbeat, WorkerStatus, encode
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context
from tests.scheduler.live.scheduler_harness import leading

pytestmark = pytest.mark.integration


async def test_a_new_session_goes_to_the_worker_whose_pass_ends_first(env):
    async with mesh_context(env) as (ctx, _), leading(ctx, env, max_gpus=2) as (live, core):
        for wid in ("wa", "wb"):
            await ctx.registry.register_worker(
                WorkerRecord(wid, WorkerStatus.READY, capacity=4, gpu_kind=core.gpu_kind),
                ttl_s=30.0,
            )
        await eventually(
            lambda: {"wa", "wb"} <= set(live.pool.workers),
            5,
            "the scheduler takes both workers in",
        )
        # Both empty: without step reports the first to join would get the session. Its
        # pass in flight ends a minute from now, the other's in a few seconds.
        first, second = list(core.view.gpus)[:2]
        now = time.time()
        ends = {first: now + 60.0, second: now + 3.0}
        for wid, ends_at in ends.items():
            beat = Heartbeat(
                worker_id=wid,
                status=WorkerStatus.READY,
                capacity=4,
                active=0,
                gpu_kind=core.gpu_kind,
                pass_ends_at=ends_at,
            )
            await ctx.nc.publish(ctx.subjects.worker_heartbeat(beat.worker_id), encode(beat))

        def heard() -> bool:
            beats = live.ingest.beats
            return all(w in beats and beats[w].pass_ends_at == ends[w] for w in ends)

        await eventually(heard, 5, "both heartbeats heard")

        record = await ctx.registry.create_session("s", "a fox", 0)
        await live.step(Event(time.time(), EventKind.ARRIVE, session_id=record.id))
        assert core.view.placement.get("s") == second

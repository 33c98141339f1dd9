"""The quality budget, live: the core's ``SetSteps`` reaches the worker as a STEPS command, and
a worker whose heartbeat shows another budget (it restarted, or the command was lost) is sent
the budget again. The worker here is a stand-in on the real NATS that answers every command
and records the STEPS ones, so that the test sees exactly what the scheduler sends."""

from __future__ import annotations

import time

import pytest

from services.scheduler.core.types import Event, EventKind
from shared.profile import DEFAULT_PROFILE, load_profile
from shared.registry import WorkerRecord
from shared.wire import (
    CommandReply,
    Heartbeat,
    WorkerCmdKind,
    WorkerCommand,
    WorkerStatus,
    decode,
    encode,
)
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context
from tests.scheduler.live.scheduler_harness import leading

pytestmark = pytest.mark.integration

FULL_STEPS = 4


async def test_an_overfull_worker_is_sent_fewer_steps_and_sent_them_again_after_a_restart(env):
    steps_sent: list[int | None] = []

    async def answer(msg):
        cmd = decode(msg.subject, msg.data, WorkerCommand)
        if cmd.kind is WorkerCmdKind.STEPS:
            steps_sent.append(cmd.steps)
        reply = CommandReply(worker_id=cmd.worker_id, ok=True, command_id=cmd.command_id)
        await msg.respond(encode(reply))

    async with (
        mesh_context(env) as (ctx, _),
        leading(ctx, env, max_gpus=1, min_gpus=1, min_steps=2) as (live, core),
    ):
        await ctx.nc.subscribe(ctx.subjects.worker_cmd("wa"), cb=answer)
        await ctx.registry.register_worker(
            WorkerRecord("wa", WorkerStatus.READY, capacity=64, gpu_kind=core.gpu_kind),
            ttl_s=30.0,
        )
        await eventually(lambda: "wa" in live.ledger.workers, 5, "the scheduler takes wa in")
        capacity = load_profile(DEFAULT_PROFILE).capacity
        for i in range(capacity + 2):  # more than full steps serve on time; no GPU to add
            record = await ctx.registry.create_session(f"s{i}", "a fox", i)
            await live.step(Event(time.time(), EventKind.ARRIVE, session_id=record.id))
        await eventually(lambda: steps_sent, 10, "a STEPS command reaches the worker")
        lowered = steps_sent[-1]
        assert lowered is not None and 2 <= lowered < FULL_STEPS

        # The worker restarts at its full count: its heartbeat shows it, and the scheduler
        # sends the budget again (once, not on every beat).
        sent_before = len(steps_sent)
        for _ in range(3):
            beat = Heartbeat(
                worker_id="wa",
                status=WorkerStatus.READY,
                capacity=64,
                active=capacity + 2,
                gpu_kind=core.gpu_kind,
                steps=FULL_STEPS,
                full_steps=FULL_STEPS,
                min_steps=2,
            )
            await ctx.nc.publish(ctx.subjects.worker_heartbeat, encode(beat))
        await eventually(
            lambda: len(steps_sent) > sent_before, 10, "the budget is sent again after a restart"
        )
        assert steps_sent[sent_before] == lowered

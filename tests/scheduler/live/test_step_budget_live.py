"""The quality budget, live: the core's ``SetSteps`` reaches the worker as a STEPS command, and
a worker whose heartbeat shows another budget (it restarted, or the command was lost) is sent
the budget again. The worker here is a stand-in on the real NATS that answers every command
and records the STEPS ones, so that the test sees exactly what the scheduler sends."""

from __future__ import annotations

import asyncio
import time
from typing import Any

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
MIN_STEPS = 2


class StandInWorker:
    """Answers every command, holds the sessions it is assigned, runs the step budget it is
    sent (within its floor and full count) and beats like a worker, so that the scheduler
    keeps it in the pool; ``restart`` forgets the budget, as a restarted worker would."""

    def __init__(self, ctx: Any, wid: str, kind: str) -> None:
        self.ctx, self.wid, self.kind = ctx, wid, kind
        self.steps = FULL_STEPS
        self.sent: list[int | None] = []  # the steps of every STEPS command, in order
        self.sessions: list[str] = []

    async def answer(self, msg: Any) -> None:
        cmd = decode(msg.subject, msg.data, WorkerCommand)
        if cmd.kind is WorkerCmdKind.STEPS:
            self.sent.append(cmd.steps)
            if cmd.steps is not None:
                self.steps = min(FULL_STEPS, max(MIN_STEPS, cmd.steps))
        elif cmd.kind is WorkerCmdKind.ASSIGN and cmd.session_id:
            self.sessions.append(cmd.session_id)
        reply = CommandReply(worker_id=cmd.worker_id, ok=True, command_id=cmd.command_id)
        await msg.respond(encode(reply))

    async def beat(self) -> None:
        while True:
            beat = Heartbeat(
                worker_id=self.wid,
                status=WorkerStatus.READY,
                capacity=64,
                active=len(self.sessions),
                sessions=list(self.sessions),
                gpu_kind=self.kind,
                steps=self.steps,
                full_steps=FULL_STEPS,
                min_steps=MIN_STEPS,
            )
            await self.ctx.nc.publish(
                self.ctx.subjects.worker_heartbeat(beat.worker_id), encode(beat)
            )
            await asyncio.sleep(0.2)

    def restart(self) -> None:
        self.steps = FULL_STEPS


async def test_an_overfull_worker_is_sent_fewer_steps_and_sent_them_again_after_a_restart(env):
    async with (
        mesh_context(env) as (ctx, _),
        leading(ctx, env, max_gpus=1, min_gpus=1, min_steps=MIN_STEPS) as (live, core),
    ):
        worker = StandInWorker(ctx, "wa", core.gpu_kind)
        await ctx.nc.subscribe(ctx.subjects.worker_cmd("wa"), cb=worker.answer)
        beating = asyncio.create_task(worker.beat())
        try:
            await ctx.registry.register_worker(
                WorkerRecord("wa", WorkerStatus.READY, capacity=64, gpu_kind=core.gpu_kind),
                ttl_s=30.0,
            )
            await eventually(lambda: "wa" in live.pool.workers, 5, "the scheduler takes wa in")
            capacity = load_profile(DEFAULT_PROFILE).capacity
            for i in range(capacity + 2):  # more than full steps serve on time; no GPU to add
                record = await ctx.registry.create_session(f"s{i}", "a fox", i)
                await live.step(Event(time.time(), EventKind.ARRIVE, session_id=record.id))
            await eventually(lambda: worker.steps < FULL_STEPS, 10, "the worker runs fewer steps")
            lowered = worker.sent[-1]
            assert lowered is not None and MIN_STEPS <= lowered < FULL_STEPS

            # The worker restarts at its full count: its heartbeat shows it, and the scheduler
            # sends the budget again.
            sent_before = len(worker.sent)
            worker.restart()
            await eventually(
                lambda: worker.steps == lowered, 10, "the budget is sent again after a restart"
            )
            assert worker.sent[sent_before:] == [lowered]
            assert "wa" in live.pool.workers
        finally:
            beating.cancel()

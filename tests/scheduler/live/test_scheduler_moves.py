"""The live scheduler's decisions about a session whose migration is in flight, with real worker
processes (tiny model, CPU, gloo), the real NATS and Redis and the policy core.

The core moves a session in its view when it decides a migration; the registry, and the worker
that runs it, follow when the handoff commits. A pause the core decides in between must still
reach the session where it lands: dropped, it would leave the session generating for nobody
on a slot the core counts free."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.scheduler.core.pool import MoveThenResume
from services.scheduler.core.types import Event, EventKind
from shared.states import SessionState
from shared.wire import NoticeKind, WorkerCmdKind, WorkerCommand
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import (
    mesh_context,
    send,
    start_session,
    worker_processes,
)
from tests.scheduler.live.scheduler_harness import leading

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PERIOD = 0.2


async def test_a_pause_decided_during_a_migration_suspends_the_session_where_it_lands(env):
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD),
    ):
        await start_session(ctx, "wa", "s")
        await eventually(lambda: len(rx.chunks["s"]) >= 3, 30, "chunks on wa")

        async with leading(ctx, env) as (live, core):
            # its view from the registry: wa and wb ready, s on wa
            assert core.view.placement == {"s": "wa"} and set(core.view.gpus) == {"wa", "wb"}
            # An operator drains wa: the core moves s to wb at once (in its view) ...
            await live.step(Event(time.time(), EventKind.GPU_DRAIN, gpu_id="wa"))
            assert core.view.placement.get("s") == "wb" and "s" in live.pool.moving
            # ... and the viewer pauses before the handoff has committed.
            await live.step(Event(time.time(), EventKind.IDLE, session_id="s"))
            assert core.view.is_idle("s")

            async def suspended_on_wb() -> bool:
                record = await ctx.registry.get_session("s")
                return (
                    record is not None
                    and record.owner == "wb"
                    and record.state is SessionState.SUSPENDED
                )

            await eventually(suspended_on_wb, 30, "s suspended on wb")
            # The worker stops generating it: no chunk comes a few periods after the suspend.
            await asyncio.sleep(4 * PERIOD)
            count = len(rx.chunks["s"])
            await asyncio.sleep(6 * PERIOD)
            assert len(rx.chunks["s"]) == count, "wb still generates the paused session"
            assert {c.worker_id for _, c in rx.chunks["s"]} <= {"wa", "wb"}


async def test_a_resume_whose_parked_state_moves_stays_suspended_if_the_viewer_paused_again(env):
    """A resume on another worker than the one its state is parked on moves the state first;
    a pause that the core decides meanwhile leaves it suspended where it lands."""
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD),
    ):
        epoch = await start_session(ctx, "wa", "s")
        await eventually(lambda: len(rx.chunks["s"]) >= 2, 30, "chunks on wa")
        record = await ctx.registry.transition(
            "s", SessionState.SUSPENDED, expected_epoch=epoch, bump_epoch=False
        )
        await send(
            ctx,
            WorkerCommand(
                kind=WorkerCmdKind.SUSPEND, worker_id="wa", epoch=record.epoch, session_id="s"
            ),
        )
        await eventually(
            lambda: any(n.kind is NoticeKind.SUSPENDED for n in rx.notices["s"]),
            30,
            "s suspended on wa",
        )

        async with leading(ctx, env) as (live, core):
            assert core.view.is_idle("s")  # the viewer paused again before the move was done
            await live.executor.move_then_resume(MoveThenResume("s", "wa", "wb"))
            record = await ctx.registry.get_session("s")
            assert record.owner == "wb" and record.state is SessionState.SUSPENDED
            count = len(rx.chunks["s"])
            await asyncio.sleep(6 * PERIOD)
            assert len(rx.chunks["s"]) == count, "the moved session was resumed"


async def test_a_session_its_worker_hands_back_is_placed_again_without_a_viewer_action(env):
    """A worker with no free slot for an assignment hands the session back (pending in the
    registry) while the core still has it on that worker. The repair pass notices and the core
    places it again; here, once the only worker has room, without any viewer action."""
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa"], chunk_period_s=PERIOD, max_sessions=1),
    ):
        epoch = await start_session(ctx, "wa", "a")
        await eventually(lambda: len(rx.chunks["a"]) >= 2, 30, "chunks of a")

        async with leading(ctx, env, max_gpus=1, retry_backoff_s=0.5) as (live, core):
            await ctx.registry.create_session("b", "p", 2)
            await live.step(Event(time.time(), EventKind.ARRIVE, session_id="b"))
            assert core.view.placement.get("b") == "wa"

            async def handed_back_and_noticed() -> bool:
                record = await ctx.registry.get_session("b")
                return (
                    record is not None
                    and record.state is SessionState.PENDING
                    and core.view.placement.get("b") != "wa"
                )

            await eventually(handed_back_and_noticed, 20, "the core to learn that wa handed b back")

            # a leaves: the slot frees, and b is placed there and runs.
            await ctx.registry.transition("a", SessionState.TERMINATED, expected_epoch=epoch)
            await send(
                ctx,
                WorkerCommand(kind=WorkerCmdKind.STOP, worker_id="wa", epoch=epoch, session_id="a"),
            )
            await live.step(Event(time.time(), EventKind.DEPART, session_id="a"))
            await eventually(lambda: len(rx.chunks["b"]) >= 2, 30, "chunks of b on wa")

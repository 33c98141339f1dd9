"""An operator's drain with the closed loop running and sessions streaming (real worker
processes, tiny model on the CPU, the live scheduler over the real NATS and Redis): the drain
waits for moves already under way instead of failing, the drained worker stays up, empty, out
of placement and out of the autoscaler's count until ``undrain``, and ``drain --stop`` has it
given back."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.scheduler.core.types import GpuState
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import (
    Received,
    mesh_context,
    start_session,
    worker_processes,
)
from tests.scheduler.live.scheduler_harness import leading
from tools.ctl import Ctl, CtlError

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PERIOD = 0.2
SIDS = ("s1", "s2", "s3")


def consecutive(rx: Received, sid: str) -> bool:
    seqs = rx.seqs(sid)
    return seqs == list(range(len(seqs)))


async def test_an_operator_drain_holds_until_undrain_with_the_loop_running(env):
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD),
    ):
        for sid in SIDS:
            await start_session(ctx, "wa", sid)
        await eventually(lambda: all(len(rx.chunks[s]) >= 2 for s in SIDS), 30, "streams on wa")
        async with leading(ctx, env, min_gpus=1, max_gpus=2) as (live, core):
            ctl = Ctl(ctx)
            # A move of s1 is under way when the drain starts: the drain waits for it.
            moving = asyncio.create_task(ctl.migrate("s1", "wb", 30))
            await asyncio.sleep(0.05)
            moved = await ctl.drain("wa", 60)
            with contextlib.suppress(CtlError):  # the scheduler may have moved s1 first
                await moving
            # s2 and s3 at least were on wa when the drain began: whoever moved them counts.
            assert moved >= len(SIDS) - 1
            placement = await ctx.registry.placement()
            assert all(placement[s] == "wb" for s in SIDS)

            # Held: ticks of the closed loop pass; wa stays up, empty, cordoned, uncounted. The
            # wait is the test: fifteen ticks in which nothing may change.
            await asyncio.sleep(3.0)
            assert core.view.state_of("wa") is GpuState.DRAINING and core.view.cordoned == ("wa",)
            assert "wa" not in live.pool.unreleased
            status = {w["id"]: w for w in (await ctl.status())["workers"]}
            assert status["wa"]["status"] == "drained" and status["wa"]["alive"]
            scheduler = await ctx.registry.scheduler_status()
            assert scheduler is not None and scheduler["cordoned"] == ["wa"]
            assert scheduler["ready"] == 1  # the autoscaler counts wb alone
            counts = {s: len(rx.chunks[s]) for s in SIDS}
            await eventually(
                lambda: all(len(rx.chunks[s]) >= counts[s] + 3 for s in SIDS), 30, "streams on wb"
            )
            assert all(consecutive(rx, s) for s in SIDS)

            # Undrain: wa is back in placement.
            await ctl.undrain("wa")

            async def ready_again() -> bool:
                return core.view.state_of("wa") is GpuState.READY and not core.view.cordoned

            await eventually(ready_again, 10, "wa back in placement")
            assert await ctx.registry.operator_drains() == {}

            # drain --stop: the scheduler gives it back once empty (no provisioner here to
            # stop it, so the worker runs on and the command says so).
            with pytest.raises(CtlError, match="still running"):
                await ctl.drain("wa", 4, stop=True)

            async def given_back() -> bool:  # the loop's next tick, on a busy machine too
                return core.view.state_of("wa") is None and "wa" in live.pool.unreleased

            await eventually(given_back, 10, "wa given back")


async def test_ctl_stop_without_a_scheduler_asks_the_provisioner(env, nats_client):
    """`ctl stop` where no scheduler leads: the drained worker is stopped by the provisioner,
    at ctl's request, and the command returns once it is gone."""
    from services.provisioner.service import ProvisionerService
    from shared.runner import running
    from shared.settings import ProvisionerSettings
    from shared.wire import ProvisionerCmdKind, WorkerStatus
    from tests.provisioner.support import EventLog, request

    settings = ProvisionerSettings.from_env(
        {**env, "TURBOSERVE_GPUS": "none"}, min_workers=0, max_workers=1
    )
    async with running(ProvisionerService(settings), settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        reply = await request(nats_client, ctx.subjects, ProvisionerCmdKind.START, ["w1"])
        assert reply.started == ["w1"]
        await events.wait("w1", WorkerStatus.READY, timeout=90)
        assert await ctx.registry.scheduler_status() is None
        moved = await Ctl(ctx).drain("w1", 60, stop=True)
        assert moved == 0
        gone = await events.wait("w1", WorkerStatus.GONE, timeout=30)
        assert gone.code == "stopped"
        assert "w1" not in {w.id for w in await ctx.registry.workers() if w.alive}
        assert await ctx.registry.operator_drains() == {}


async def test_a_drain_fills_no_worker_past_its_slots(env):
    """Three sessions drained off ``wa`` onto two workers of two slots each, whose records lag
    (a heartbeat every 10 s: both still say 0 active while the moves land). Each move goes
    where the registry counts a free slot, so neither ends with more than its two, and the
    drain moves all three; by the records alone all three would go to one of them."""
    slots = {"TURBOSERVE_MAX_SESSIONS": "2"}
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(
            ctx,
            env,
            ["wa", "wb", "wc"],
            per_worker={"wb": slots, "wc": slots},
            chunk_period_s=PERIOD,
            heartbeat_s=10.0,
        ),
    ):
        for sid in SIDS:
            await start_session(ctx, "wa", sid)
        await eventually(lambda: all(len(rx.chunks[s]) >= 2 for s in SIDS), 30, "streams on wa")
        assert await ctx.registry.scheduler_status() is None  # ctl moves every session itself
        ctl = Ctl(ctx)
        moved = await ctl.drain("wa", 60)
        assert moved == len(SIDS)
        placement = await ctx.registry.placement()
        held = {w: sorted(s for s, owner in placement.items() if owner == w) for w in ("wb", "wc")}
        assert all(len(sessions) <= 2 for sessions in held.values()), held
        assert sorted(held["wb"] + held["wc"]) == sorted(SIDS)
        counts = {s: len(rx.chunks[s]) for s in SIDS}
        await eventually(
            lambda: all(len(rx.chunks[s]) >= counts[s] + 2 for s in SIDS), 30, "streams moved"
        )

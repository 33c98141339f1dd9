"""A release the provisioner refuses for good is not asked again; an operator's stop at the
floor is refused before anything moves.

The core gives a GPU back when it scales in; from then on it leaves it out of the pool. The
scheduler follows the floor the provisioner records, so it does not give back what the floor
keeps. If a stop is refused all the same for the floor (here: a record that says one worker
while the provisioner keeps two), asking again cannot help: the scheduler does not, the core
has the GPU again and it serves, and the provisioner writes its record again, which the
scheduler follows. `ctl stop` of a worker at the floor says so at once, with a non-zero exit,
and nothing is left to retry; an operator's stop that reaches the provisioner all the same is
refused once and the worker stays drained, held. Real provisioner, real worker processes,
real NATS and Redis; the scale-in is the core's own decision."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from services.provisioner.service import ProvisionerService
from services.scheduler.core.types import Event, EventKind, GpuState
from shared.profile import DEFAULT_PROFILE, load_profile
from shared.registry import PoolLimits
from shared.runner import ServiceContext, running
from shared.settings import ProvisionerSettings
from shared.wire import ProvisionerCmdKind, ProvisionerCommand, WorkerStatus, decode
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context
from tests.scheduler.live.scheduler_harness import leading
from tools.ctl import Ctl, CtlError

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def service_env(infra: Any, isolation: dict[str, str]) -> dict[str, str]:
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
    }


@asynccontextmanager
async def floor_of_two(
    env: dict[str, str],
) -> AsyncIterator[tuple[ProvisionerService, ServiceContext]]:
    """A provisioner keeping a floor of two emulated workers (and at most two), both ready."""
    settings = ProvisionerSettings.from_env(
        env, min_workers=2, max_workers=2, shutdown_grace_s=10.0
    )
    provisioner = ProvisionerService(settings)
    async with running(provisioner, settings), mesh_context(env) as (ctx, _):

        async def two_ready() -> bool:
            ready = [
                w for w in await ctx.registry.workers() if w.alive and w.status.value == "ready"
            ]
            return len(ready) == 2

        await eventually(two_ready, 90, "the provisioner's two workers")
        yield provisioner, ctx


async def stops_sent(nats_client: Any, ctx: ServiceContext) -> list[list[str]]:
    """Every STOP sent to the provisioner from now on (the workers named in each), as it
    comes."""
    stops: list[list[str]] = []

    async def on_cmd(msg: Any) -> None:
        cmd = decode(msg.subject, msg.data, ProvisionerCommand)
        if cmd.kind is ProvisionerCmdKind.STOP:
            stops.append(list(cmd.worker_ids))

    await nats_client.subscribe(ctx.subjects.provisioner_cmd, cb=on_cmd)
    await nats_client.flush()
    return stops


async def test_a_release_the_floor_refuses_is_not_asked_again(
    infra, isolation, nats_client, monkeypatch
):
    monkeypatch.setenv("TURBOSERVE_EMULATE", load_profile(DEFAULT_PROFILE).gpu_kind)
    env = service_env(infra, isolation)
    async with floor_of_two(env) as (provisioner, ctx):
        stops = await stops_sent(nats_client, ctx)
        # No sessions, a core started with a floor of one (an earlier run's record): it
        # follows the provisioner's record of two, and gives nothing back.
        async with leading(ctx, env, boot_delay_s=0.5) as (live, core):

            async def floor_followed() -> bool:
                return core.config.min_gpus == 2 and len(core.view.gpus) == 2

            await eventually(floor_followed, 10, "the provisioner's floor followed")
            # The wait below is the test: fifteen ticks, nothing given back.
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                assert len(core.view.gpus) == 2 and not live.pool.unreleased
                await asyncio.sleep(0.2)
            assert stops == []

            # A record that says one worker while the provisioner keeps two: the core gives
            # one GPU back, and the provisioner refuses the stop (its floor).
            limits = await ctx.registry.pool_limits()
            assert limits is not None
            await ctx.registry.set_pool_limits(PoolLimits(1, limits.max_workers, limits.backend))
            await eventually(lambda: len(stops) >= 1, 30, "the core's scale-in")
            released = stops[0][0]

            # Not asked again: the core has the GPU back, the provisioner's record of two is
            # followed again, and the worker takes sessions (undrained). The wait is the test.
            async def kept() -> bool:
                records = {w.id: w for w in await ctx.registry.workers()}
                return (
                    core.view.state_of(released) is GpuState.READY
                    and core.config.min_gpus == 2
                    and records[released].status is WorkerStatus.READY
                )

            await eventually(kept, 30, "the refused GPU kept in the pool")
            await asyncio.sleep(5.0)
            assert stops == [[released]], stops
            assert not live.pool.unreleased and len(core.view.gpus) == 2
            assert released in provisioner.backend.workers
            status = await ctx.registry.scheduler_status()
            assert status is not None and status["releasing"] == 0 and status["gpus"] == 2


async def test_ctl_stop_at_the_floor_is_refused_at_once_and_nothing_retries(
    infra, isolation, nats_client, monkeypatch
):
    monkeypatch.setenv("TURBOSERVE_EMULATE", load_profile(DEFAULT_PROFILE).gpu_kind)
    env = service_env(infra, isolation)
    async with floor_of_two(env) as (provisioner, ctx):
        stops = await stops_sent(nats_client, ctx)
        async with leading(ctx, env, boot_delay_s=0.5) as (live, core):
            await eventually(
                lambda: core.config.min_gpus == 2 and len(core.view.gpus) == 2, 10, "the floor"
            )
            victim = sorted(core.view.gpus)[0]
            ctl = Ctl(ctx)

            # The library: refused before anything is recorded or moved.
            with pytest.raises(CtlError, match="below its floor of 2") as refused:
                await ctl.drain(victim, 30, stop=True)
            assert refused.value.code == "min_workers"
            assert await ctx.registry.operator_drains() == {}

            # The command line: one line saying why and what to do, a non-zero exit, at once.
            started = time.monotonic()
            cli = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "tools.cli", "ctl", "stop", victim],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert cli.returncode == 2, (cli.stdout, cli.stderr)
            assert "below its floor of 2" in cli.stderr and "TURBOSERVE_MIN_WORKERS" in cli.stderr
            assert time.monotonic() - started < 20  # no drain waited for

            # Nothing retries: no stop was ever sent; the worker serves on. The wait is the test.
            await asyncio.sleep(3.0)
            assert stops == []
            assert core.view.state_of(victim) is GpuState.READY and not live.pool.unreleased
            assert await ctx.registry.operator_drains() == {}

            # A stop that reaches the provisioner all the same (recorded by a ctl that checked
            # before the pool shrank): drained, refused once, then held, not retried.
            await ctx.registry.set_operator_drain(victim, "stop")

            async def held() -> bool:
                return victim in core.view.cordoned

            await eventually(held, 30, "the refused worker held")
            assert await ctx.registry.operator_drains() == {victim: "hold"}
            await asyncio.sleep(5.0)
            assert stops == [[victim]], stops
            assert not live.pool.unreleased and victim in provisioner.backend.workers
            status = {w["id"]: w for w in (await ctl.status())["workers"]}
            assert status[victim]["status"] == "drained" and status[victim]["alive"]


async def test_a_worker_that_comes_up_after_its_boot_timed_out_is_stopped(
    infra, isolation, nats_client, monkeypatch
):
    """The scheduler gives up on a GPU that takes longer than its boot timeout, and the core
    never takes that name again. A worker that comes up all the same is stopped, not left
    running outside the pool."""
    monkeypatch.setenv("TURBOSERVE_EMULATE", load_profile(DEFAULT_PROFILE).gpu_kind)
    env = service_env(infra, isolation)
    prov_settings = ProvisionerSettings.from_env(
        env, min_workers=0, max_workers=1, boot_delay_s=3.0, shutdown_grace_s=10.0
    )
    provisioner = ProvisionerService(prov_settings)
    async with running(provisioner, prov_settings), mesh_context(env) as (ctx, _):
        async with leading(
            ctx, env, settings={"boot_timeout_s": 1.0}, min_gpus=0, max_gpus=1, boot_delay_s=0.5
        ) as (live, core):
            await live.step(Event(time.time(), EventKind.ARRIVE, session_id="s"))
            assert len(live.pool.booting) == 1, "the core asked for no GPU"
            late = next(iter(live.pool.booting))

            async def timed_out() -> bool:
                return late not in live.pool.booting

            await eventually(timed_out, 10, "the boot timeout")
            await live.step(Event(time.time(), EventKind.DEPART, session_id="s"))

            async def came_up() -> bool:
                return late in provisioner.backend.workers

            await eventually(came_up, 30, "the late worker's process")

            async def stopped() -> bool:
                return late not in provisioner.backend.workers and late not in live.pool.workers

            await eventually(stopped, 90, "the late worker to be stopped")
            assert late not in core.view.gpus and not live.pool.unreleased

"""A release that does not go through is tried again until the worker stops.

The core gives a GPU back when it scales in; from then on it leaves it out of the pool. The
scheduler follows the floor the provisioner records, so it does not give back what the floor
keeps. If a stop is refused all the same (here: a record that says one worker while the
provisioner keeps two), the worker must not run on, paid for and unused, because nobody decided
to keep it: the live scheduler keeps the release pending, tries it again with a growing pause,
and the worker stops as soon as the provisioner takes the stop. Real provisioner, real worker
processes, real NATS and Redis; the scale-in is the core's own decision."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.provisioner.service import ProvisionerService
from services.scheduler.core.types import Event, EventKind
from shared.profile import DEFAULT_PROFILE, load_profile
from shared.registry import PoolLimits
from shared.runner import running
from shared.settings import ProvisionerSettings
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context
from tests.scheduler.live.scheduler_harness import leading

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_refused_release_is_retried_until_the_worker_stops(
    infra, isolation, nats_client, monkeypatch
):
    monkeypatch.setenv("TURBOSERVE_EMULATE", load_profile(DEFAULT_PROFILE).gpu_kind)
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
    }
    prov_settings = ProvisionerSettings.from_env(
        env, min_workers=2, max_workers=2, shutdown_grace_s=10.0
    )
    provisioner = ProvisionerService(prov_settings)
    async with running(provisioner, prov_settings), mesh_context(env) as (ctx, _):

        async def two_ready() -> bool:
            ready = [
                w for w in await ctx.registry.workers() if w.alive and w.status.value == "ready"
            ]
            return len(ready) == 2

        await eventually(two_ready, 90, "the provisioner's two workers")

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

            # A record that says one worker while the provisioner keeps two: the core keeps one
            # GPU and gives the other back.
            limits = await ctx.registry.pool_limits()
            assert limits is not None
            await ctx.registry.set_pool_limits(PoolLimits(1, limits.max_workers, limits.backend))

            async def one_given_back() -> bool:
                return len(core.view.gpus) == 1 and len(live.pool.workers) == 2

            await eventually(one_given_back, 30, "the core's scale-in")
            kept = next(iter(core.view.gpus))
            released = next(w for w in live.pool.workers if w != kept)

            # The provisioner refuses the stop (its floor): the release stays pending and is
            # tried again, the worker still runs, and the status says so.
            async def refused_twice() -> bool:
                return live.pool.unreleased.get(released, (0.0, 0))[1] >= 2

            await eventually(refused_twice, 30, "a second refused attempt")
            assert released in provisioner.backend.workers
            assert (await ctx.registry.scheduler_status())["releasing"] == 1

            # The floor is lowered (the operator aligns the provisioner with the scheduler):
            # the next attempt goes through, and the worker stops.
            provisioner.pool.min_workers = 1

            async def stopped() -> bool:
                return released not in live.pool.workers and not live.pool.unreleased

            await eventually(stopped, 60, "the retried release to stop the worker")
            assert released not in provisioner.backend.workers
            assert kept in provisioner.backend.workers and set(live.pool.workers) == {kept}
            assert set(core.view.gpus) == {kept}


async def test_a_worker_that_comes_up_after_its_boot_timed_out_is_stopped(
    infra, isolation, nats_client, monkeypatch
):
    """The scheduler gives up on a GPU that takes longer than its boot timeout, and the core
    never takes that name again. A worker that comes up all the same is stopped, not left
    running outside the pool."""
    monkeypatch.setenv("TURBOSERVE_EMULATE", load_profile(DEFAULT_PROFILE).gpu_kind)
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
    }
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

"""The live scheduler's repair pass against a real Redis: a session the registry places elsewhere
than the core thinks is taken back, unless a migration of it is in flight (the core moves a
session when it decides, the registry when the handoff commits)."""

from __future__ import annotations

import time

import pytest

from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.policies import LIVE_POLICIES
from services.scheduler.core.types import GpuState, RestoredGpu, RestoredSession
from services.scheduler.live import LiveScheduler
from services.scheduler.metrics import SchedulerMetrics
from shared.leader import LeaderElection
from shared.profile import DEFAULT_PROFILE, load_profile
from shared.settings import SchedulerSettings
from tests.gpu_worker.worker_harness import mesh_context

pytestmark = pytest.mark.integration


async def test_a_session_being_migrated_is_not_taken_back_to_its_source(env):
    async with mesh_context(env) as (ctx, _):
        settings = SchedulerSettings.from_env(env)
        lease = await LeaderElection(ctx.redis, ctx.registry.ns, "test", 5.0).try_acquire()
        assert lease is not None
        profile = load_profile(DEFAULT_PROFILE)
        kind = profile.gpu_kind
        core = LIVE_POLICIES.build(
            "turboserve",
            {kind: profile},
            ControllerConfig(
                initial_gpus=0, min_gpus=1, max_gpus=2, gpu_kind=kind, boot_delay_s=5.0
            ),
        )
        now = time.time()
        core.restore(
            [RestoredGpu("a", kind, GpuState.READY), RestoredGpu("b", kind, GpuState.READY)],
            [RestoredSession("s", active=True, gpu_id="b")],
            now,
        )
        live = LiveScheduler(ctx, settings, lease, core, {kind: profile}, kind, SchedulerMetrics())
        live.pool.join("a", kind, now)
        live.pool.join("b", kind, now)
        record = await ctx.registry.create_session("s", "p", 0)
        await ctx.registry.claim("s", "a", record.epoch)  # the handoff a -> b has not committed

        live.pool.moving["s"] = 1  # a Migrate a -> b in flight
        await live.ingest.reconcile()
        assert core.view.placement["s"] == "b"

        live.pool.migration_ended("s")  # it ended, and the registry still says a: it failed
        assert not live.pool.moving
        await live.ingest.reconcile()
        assert core.view.placement["s"] == "a"

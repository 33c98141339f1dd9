"""A live scheduler leading over the real NATS and Redis, for tests that drive it themselves:
its core is the real policy core, its view rebuilt from the registry as a new leader's is."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from services.scheduler.core.loop import Controller
from services.scheduler.core.policies import LIVE_POLICIES
from services.scheduler.live import LiveScheduler
from services.scheduler.metrics import SchedulerMetrics
from shared.leader import LeaderElection
from shared.profile import DEFAULT_PROFILE, load_profile
from shared.runner import ServiceContext
from shared.settings import SchedulerSettings
from shared.streams import ensure_streams


@contextlib.asynccontextmanager
async def leading(
    ctx: ServiceContext,
    env: dict[str, str],
    *,
    tick_s: float = 0.2,
    settings: dict[str, Any] | None = None,
    **core: Any,
) -> AsyncIterator[tuple[LiveScheduler, Controller]]:
    """A started ``LiveScheduler`` holding a lease that outlasts the test, over a ``turboserve``
    core on the default profile (fixed rho_hat 0.9, a 30 s boot, 1-2 GPUs; ``core`` overrides
    these); ``settings`` go to ``SchedulerSettings``."""
    await ensure_streams(ctx.js, ctx.subjects)  # as the scheduler service does
    profile = load_profile(DEFAULT_PROFILE)
    kind = profile.gpu_kind
    lease = await LeaderElection(ctx.redis, ctx.registry.ns, "test", 120.0).try_acquire()
    assert lease is not None
    params: dict[str, Any] = {
        "initial_gpus": 0,
        "min_gpus": 1,
        "max_gpus": 2,
        "gpu_kind": kind,
        "boot_delay_s": 30.0,
        "rho_hat": 0.9,
        **core,
    }
    controller = LIVE_POLICIES.build(
        "turboserve", {kind: profile}, LIVE_POLICIES.config("turboserve", params)
    )
    assert isinstance(controller, Controller)
    live = LiveScheduler(
        ctx,
        SchedulerSettings.from_env(env, tick_s=tick_s, **(settings or {})),
        lease,
        controller,
        {kind: profile},
        kind,
        SchedulerMetrics(),
    )
    await live.start()
    try:
        yield live, controller
    finally:
        await live.stop()

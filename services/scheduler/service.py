"""The scheduler service: active/standby around a leader lease in Redis.

Every scheduler process tries to take the lease; the one that holds it runs the closed loop
(:class:`~services.scheduler.live.LiveScheduler`: the policy core fed from NATS and Redis),
renewing the lease a few times per TTL. A standby retries the lease, and within a TTL of the
leader's death takes over: it rebuilds the core's view from Redis and the heartbeats, and
continues from the durable JetStream consumer where the old leader stopped. A leader that cannot
renew (deposed, partitioned from Redis) stops deciding at once; its registry writes are guarded
by the lease and its worker commands carry its term, so nothing it sends afterwards is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from redis.exceptions import RedisError

from services.scheduler.core.autoscale import RhoTable, RhoTableError
from services.scheduler.core.policies import LIVE_POLICIES, Policy
from services.scheduler.core.quality import check_min_steps
from services.scheduler.live import LiveScheduler
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.unplaced import Unplaced
from shared.leader import LeaderElection, Lease
from shared.logging import get_logger
from shared.ops import OpsServer, close_ops, start_ops
from shared.profile import LatencyProfile, ProfileError
from shared.runner import ServiceContext
from shared.settings import SchedulerSettings, SettingsError
from shared.streams import ensure_streams
from shared.video import ChunkRetention

log = get_logger("turboserve.scheduler")

# A worker needs this long beyond the configured boot delay to load its model and report in.
WORKER_START_S = 5.0


class SchedulerService:
    name = "scheduler"

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.ctx: ServiceContext | None = None
        self.metrics = SchedulerMetrics()
        self.ops: OpsServer | None = None
        self.live: LiveScheduler | None = None
        self.lease: Lease | None = None
        self._election: LeaderElection | None = None
        self._starting: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        # The records of the sessions pending in the registry, across leaderships: written
        # back when Redis lost them (``unplaced.py``).
        self.unplaced = Unplaced()
        try:
            self.profiles, self.default_kind, self.rho_table = load_inputs(settings)
        except (ProfileError, RhoTableError, OSError) as exc:
            raise SettingsError([f"scheduler inputs: {exc}"]) from None
        if settings.policy not in LIVE_POLICIES:
            raise SettingsError(
                [f"TURBOSERVE_POLICY={settings.policy!r}: one of {', '.join(LIVE_POLICIES)}"]
            )
        _check_policy_params(settings)
        if settings.min_steps is not None and "min_steps" in LIVE_POLICIES[settings.policy].params:
            # Checked here, not when the core is built at a takeover: a floor above the model's
            # full count stops the service at its start.
            try:
                check_min_steps(settings.min_steps, self.profiles[self.default_kind])
            except ValueError as exc:
                raise SettingsError([f"TURBOSERVE_MIN_STEPS={settings.min_steps}: {exc}"]) from None

    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        await ensure_streams(
            ctx.js, ctx.subjects, ChunkRetention.of(ctx.settings), ctx.settings.stream_replicas
        )
        self._election = LeaderElection(
            ctx.redis, ctx.registry.ns, self.settings.scheduler_id, self.settings.leader_ttl_s
        )
        self.ops = await start_ops(
            ctx, self.metrics.registry, service="scheduler", details=self._details
        )
        ctx.spawn(self._lead(), name="scheduler-leadership")

    async def stop(self) -> None:
        self._stopping.set()
        await self._step_down()
        await close_ops(self.ops)

    def _details(self) -> dict[str, Any]:
        return {
            "leader": self.lease is not None,
            "term": self.lease.term if self.lease is not None else None,
        }

    # -- leadership -----------------------------------------------------------------------------
    async def _lead(self) -> None:
        """Take the lease when it is free, renew it while leading (in this task only, never
        held up by the loop's own work), step down the moment a renewal fails."""
        assert self._election is not None and self.ctx is not None
        renew_every = self.settings.leader_ttl_s / 3
        while not self._stopping.is_set():
            try:
                if self.lease is None:
                    # Before the lease: a Redis restarted empty lost it with the pending
                    # sessions, which go back first (the new leader, here or elsewhere,
                    # finds them).
                    await self.unplaced.write_back(self.ctx.registry)
                    lease = await self._election.try_acquire()
                    if lease is not None:
                        self.lease = lease
                        self._starting = self.ctx.spawn(
                            self._take_over(lease), name="scheduler-takeover"
                        )
                    else:  # another scheduler leads: it places what this one no longer sees
                        self.unplaced.clear()
                elif not await self._election.renew(self.lease):
                    log.warning("scheduler_deposed", term=self.lease.term)
                    await self._step_down(resign=False)
            except RedisError as exc:
                # Redis away: a leader that cannot renew cannot prove it leads; it stops
                # deciding, and every scheduler tries again when Redis answers.
                log.warning("lease_unavailable", error=str(exc), leading=self.lease is not None)
                if self.lease is not None:
                    await self._step_down(resign=False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=renew_every)

    async def _take_over(self, lease: Lease) -> None:
        assert self.ctx is not None
        self.metrics.leader.set(1)
        log.info("scheduler_elected", term=lease.term, scheduler_id=self.settings.scheduler_id)
        limits = await self._limits()
        live = LiveScheduler(
            self.ctx,
            self.settings,
            lease,
            live_policy(self.settings, self.profiles, self.default_kind, self.rho_table, *limits),
            self.profiles,
            self.default_kind,
            self.metrics,
            handoff_timeout_s=self.settings.handoff_timeout_s,
            limits=limits,
            unplaced=self.unplaced,
        )
        self.live = live
        await live.start()

    async def _step_down(self, resign: bool = True) -> None:
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            starting.cancel()
            await asyncio.wait({starting}, timeout=5.0)
        live, self.live = self.live, None
        if live is not None:
            await live.stop()
        lease, self.lease = self.lease, None
        self.metrics.leader.set(0)
        if lease is not None and resign and self._election is not None:
            with contextlib.suppress(Exception):
                await self._election.resign(lease)

    async def _limits(self) -> tuple[int, int]:
        """The pool limits a new leadership starts from: the provisioner's record, else the
        settings. The live scheduler follows the record from then on (it changes)."""
        assert self.ctx is not None
        limits = await self.ctx.registry.pool_limits()
        if limits is None:
            return self.settings.min_workers, self.settings.max_workers
        return limits.min_workers, limits.max_workers


# What the live service sets itself (from its own settings and the provisioner's limits):
# TURBOSERVE_POLICY_PARAMS may not name them.
SERVICE_PARAMS = frozenset(
    {
        "rho_table",
        "boot_delay_s",
        "initial_gpus",
        "gpus",
        "min_gpus",
        "max_gpus",
        "floor_kept",
        "scale_cooldown_s",
        "gpu_kind",
        "gpu_id_prefix",
        "min_steps",
    }
)


def _check_policy_params(settings: SchedulerSettings) -> None:
    """TURBOSERVE_POLICY_PARAMS: names the policy takes, values it accepts, none of the
    service's own (a SettingsError that lists what it takes)."""
    given = settings.policy_param_values
    if not given:
        return
    spec = LIVE_POLICIES[settings.policy]
    owned = sorted(set(given) & SERVICE_PARAMS)
    if owned:
        raise SettingsError(
            [
                f"TURBOSERVE_POLICY_PARAMS: {', '.join(owned)} is set by the scheduler itself "
                "(its own TURBOSERVE_ settings and the provisioner's limits)"
            ]
        )
    try:
        spec.config(given)
    except (TypeError, ValueError) as exc:
        raise SettingsError([f"TURBOSERVE_POLICY_PARAMS: {exc}"]) from None


def live_policy(
    settings: SchedulerSettings,
    profiles: dict[str, LatencyProfile],
    default_kind: str,
    rho_table: RhoTable | None,
    min_gpus: int,
    max_gpus: int,
) -> Policy:
    """The policy ``settings`` name, set for the live pool: it starts with no GPU of its own
    (it finds the workers that run); an autoscaler sizes the pool between ``min_gpus`` and
    ``max_gpus`` with the rho table, a static policy keeps the pool it finds. With
    ``TURBOSERVE_MIN_STEPS`` set, a policy that has the quality budget lowers a GPU's denoising
    steps down to it while the GPU is over its budget."""
    boot = settings.boot_delay_s + WORKER_START_S
    prefix = settings.gpu_id_prefix or None
    spec = LIVE_POLICIES[settings.policy]
    params: dict[str, object]
    if spec.autoscales:
        params = {
            "rho_table": rho_table,
            "boot_delay_s": boot,
            "initial_gpus": 0,
            "min_gpus": min_gpus,
            "max_gpus": max_gpus,
            # The provisioner starts workers up to its floor by itself.
            "floor_kept": True,
            "scale_cooldown_s": settings.scale_cooldown_s,
            "gpu_kind": default_kind,
            "gpu_id_prefix": prefix,
        }
    else:
        params = {
            "gpus": 0,
            "gpu_kind": default_kind,
            "boot_delay_s": boot,
            "gpu_id_prefix": prefix,
        }
    params.update(settings.policy_param_values)  # checked at start: none of the above
    if settings.min_steps is not None:
        if "min_steps" in spec.params:
            params["min_steps"] = settings.min_steps
        else:
            log.warning(
                "quality_budget_unused",
                policy=settings.policy,
                why="this policy never lowers the denoising steps; TURBOSERVE_MIN_STEPS is ignored",
            )
    return LIVE_POLICIES.build(settings.policy, profiles, spec.config(params))


def load_inputs(
    settings: SchedulerSettings,
) -> tuple[dict[str, LatencyProfile], str, RhoTable | None]:
    """The files the core is given as values: the latency profile of the default GPU kind and
    the adaptive rho_hat table (the core itself reads no files)."""
    from services.scheduler.shipped import load_rho_table
    from shared.profile import DEFAULT_PROFILE, load_profile

    profile = load_profile(settings.profile or DEFAULT_PROFILE)
    table = None if settings.rho_table == "none" else load_rho_table(settings.rho_table or None)
    return {profile.gpu_kind: profile}, profile.gpu_kind, table

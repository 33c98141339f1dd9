"""The live scheduler: the policy core fed from NATS and Redis, its decisions carried out.

While this scheduler leads, :class:`LiveScheduler` is the thin adapter of the design around the
policy's ``step``, in three parts:

- :class:`~services.scheduler.core.pool.Pool`: the core, pure: the policy and the books of the
  pool (workers known and when last heard, GPUs booting, GPUs given back that still run, step
  budgets, migrations in flight), and every decision beyond the policy's (resume or assign,
  parking, releasing a GPU it does not hold, re-sending a step budget);
- :class:`~services.scheduler.ingest.Ingest`: what it hears becomes the core's events and facts
  (session events from the durable JetStream consumer, worker heartbeats, provisioner events,
  the registry), and when each worker's pass ends becomes the policy's ``note_pass``;
- :class:`~services.scheduler.executor.Executor`: every decision becomes commands, retried until
  answered; how one ended goes back to the core as an event or a fact.

Neither part holds this scheduler: each gets the narrow part it needs (``Steps``, ``Shell``).

Here: the lifecycle of a leadership, one step of the core at a time (and the events its
decisions give rise to, stepped right after), the timer, the latency model measured per kind,
one log line per decision (event, decision, rho_max, rho_hat, GPUs), metrics, and the
scheduler's view in Redis for operators. The core stays pure: it never waits; everything here
that waits runs in tracked tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

from nats.errors import Error as NatsError
from redis.exceptions import RedisError

from services.scheduler.commands import CommandSender
from services.scheduler.core.policies import Policy
from services.scheduler.core.pool import (
    GpuRefused,
    Input,
    MoveEnded,
    ParkedStateMoved,
    Pool,
    WorkerHeard,
    WorkerJoined,
)
from services.scheduler.core.types import (
    Event,
    EventKind,
    GpuState,
    RestoredGpu,
    RestoredSession,
)
from services.scheduler.executor import Executor, describe
from services.scheduler.ingest import Ingest
from services.scheduler.measured import differs, live_profile
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.unplaced import Unplaced
from shared.leader import Lease
from shared.logging import get_logger
from shared.profile import LatencyProfile, ProfileError
from shared.registry import RegistryError
from shared.runner import ServiceContext, subscriptions_live
from shared.settings import SchedulerSettings
from shared.states import SessionState
from shared.streams import SCHEDULER_DURABLE
from shared.supervisor import Supervisor
from shared.wire import Heartbeat, WorkerStatus

log = get_logger("turboserve.scheduler")


class LiveScheduler:
    def __init__(
        self,
        ctx: ServiceContext,
        settings: SchedulerSettings,
        lease: Lease,
        core: Policy,
        fallback: dict[str, LatencyProfile],
        default_kind: str,
        metrics: SchedulerMetrics,
        handoff_timeout_s: float = 30.0,
        limits: tuple[int, int] | None = None,
        unplaced: Unplaced | None = None,
    ) -> None:
        self.ctx = ctx
        # The pending sessions' records, written back if Redis loses them (the service's).
        self.unplaced = unplaced if unplaced is not None else Unplaced()
        # The pool limits the core was last given (min, max GPUs).
        self.limits = limits
        self.settings = settings
        self.lease = lease
        self.core = core
        self.fallback = fallback
        self.default_kind = default_kind
        self.metrics = metrics
        self.handoff_timeout_s = handoff_timeout_s
        self.sender = CommandSender(
            ctx, term=lease.term, reply_timeout_s=settings.command_timeout_s
        )
        self.lock = asyncio.Lock()  # one step of the core at a time
        self.stopping = asyncio.Event()
        self.psub: Any = None  # the durable consumer of session events
        self.pool = Pool(core, settings.worker_timeout_s, settings.boot_timeout_s, settings.tick_s)
        self.executor = Executor(
            self,
            self.pool,
            ctx.registry,
            self.sender,
            lease,
            metrics,
            handoff_timeout_s=handoff_timeout_s,
            tick_s=settings.tick_s,
            unplaced=self.unplaced,
        )
        self.ingest = Ingest(
            self,
            self.pool,
            self.executor,
            ctx.registry,
            settings,
            default_kind,
            unplaced=self.unplaced,
        )
        self._followups: deque[Input] = deque()
        self._tasks = Supervisor("scheduler_task_failed", log=log)
        self._subs: list[Any] = []
        self._loops: list[asyncio.Task[Any]] = []
        self._ticks = 0
        self._profiles_at = 0.0

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        ctx, ingest = self.ctx, self.ingest
        self._subs.append(await ctx.nc.subscribe(ctx.subjects.worker_heartbeats, cb=ingest.on_beat))
        self._subs.append(
            await ctx.nc.subscribe(ctx.subjects.provisioner_events, cb=ingest.on_pool_event)
        )
        self._subs.append(await ctx.nc.subscribe(ctx.subjects.all_migrations, cb=ingest.on_report))
        await subscriptions_live(ctx.nc)
        await asyncio.sleep(min(1.5, self.settings.worker_timeout_s / 2))  # hear the heartbeats
        await self.rebuild()
        self.psub = await ctx.js.pull_subscribe(
            ctx.subjects.session_events,
            durable=SCHEDULER_DURABLE,
            stream=ctx.subjects.sessions_stream,
        )
        # The two loops are supervised by the service: one that fails takes the scheduler down
        # (a standby takes over) rather than leaving a leader that no longer decides.
        self._loops = [
            ctx.spawn(ingest.consume(self.psub), name="scheduler-events"),
            ctx.spawn(self._tick_forever(), name="scheduler-tick"),
        ]
        log.info("scheduler_leading", term=self.lease.term, gpus=len(self.pool.workers))

    async def stop(self) -> None:
        """Stop deciding (leadership lost or shutdown); commands in flight end or are dropped."""
        self.stopping.set()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        for loop in self._loops:
            loop.cancel()
        if self._loops:
            await asyncio.wait(self._loops, timeout=5.0)
        await self._tasks.wait(timeout_s=2.0)
        await self._tasks.cancel(wait_s=5.0)
        if self.psub is not None:
            psub, self.psub = self.psub, None
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` in a task this leadership tracks (and ends with it)."""
        return self._tasks.spawn(coro, name)

    @property
    def guard(self) -> tuple[str, str]:
        return self.lease.guard

    # -- the view a new leader starts from ------------------------------------------------------
    async def rebuild(self) -> None:
        """The core's view from Redis and the heartbeats heard: GPUs, where sessions run."""
        registry = self.ctx.registry
        now = time.time()
        gpus = []
        held = await registry.operator_drains()
        for w in await registry.workers():
            if not w.alive or w.status not in (WorkerStatus.READY, WorkerStatus.DRAINING):
                continue
            state = GpuState.READY if w.status is WorkerStatus.READY else GpuState.DRAINING
            gpus.append(RestoredGpu(w.id, w.gpu_kind, state, cordoned=held.get(w.id) == "hold"))
            self.pool.join(w.id, w.gpu_kind, now)
        live = {g.gpu_id for g in gpus}
        sessions = []
        placement = await registry.placement()
        pending = await registry.pending_sessions()
        await self.unplaced.refresh(registry, pending)
        # A session no one watches (or its client paused) that holds no GPU comes back idle:
        # it waits for its viewer, not for a worker (an earlier run's session among them).
        unwatched = await registry.unwatched(
            [sid for sid, owner in placement.items() if owner not in live] + pending
        )
        for sid, owner in placement.items():
            record = await registry.get_session(sid)
            if record is None or record.state is SessionState.TERMINATED:
                continue
            if record.state is SessionState.SUSPENDED or sid in unwatched:
                sessions.append(RestoredSession(sid, active=False, in_host_ram=owner in live))
            else:
                sessions.append(
                    RestoredSession(sid, active=True, gpu_id=owner if owner in live else None)
                )
        for sid in pending:
            sessions.append(RestoredSession(sid, active=sid not in unwatched))
        self.refresh_profiles(force=True)
        self.core.restore(gpus, sessions, now)
        self.ingest.rebuilt = True
        log.info(
            "scheduler_view_rebuilt",
            gpus=len(gpus),
            sessions=len(sessions),
            idle=sum(1 for found in sessions if not found.active),
        )
        await self.step(Event(now, EventKind.TICK))

    # -- one step of the core -------------------------------------------------------------------
    async def step(self, fact: Input) -> None:
        """One step of the core on ``fact`` (one at a time), and of the facts its decisions
        give rise to."""
        async with self.lock:
            self._followups.append(fact)
            while self._followups:
                current = self._followups.popleft()
                started = time.perf_counter()
                decisions = self.pool.decide(current)
                self.metrics.decision_seconds.observe(time.perf_counter() - started)
                if decisions:
                    rho_max = self.core.rho_max()
                    gpus = self.core.view.billed_gpus
                    kind, session_id, gpu_id = _trigger(current)
                    rho_hat, _ = self.core.current_rho_hat(current.t)
                    for decision in decisions:
                        self.metrics.decisions.labels(type(decision).__name__).inc()
                        log.info(
                            "decision",
                            trigger=kind,
                            session_id=session_id,
                            gpu_id=gpu_id,
                            decision=describe(decision),
                            rho_max=round(rho_max, 3),
                            rho_hat=rho_hat,
                            gpus=gpus,
                        )
                        await self.executor.execute(decision)

    def feed(self, fact: Input) -> None:
        """A fact found while carrying out a decision: stepped right after (under the lock)."""
        self._followups.append(fact)

    async def feed_later(self, fact: Input) -> None:
        """A fact from a background task: a step of its own."""
        if not self.stopping.is_set():
            await self.step(fact)

    # -- the timer ------------------------------------------------------------------------------
    async def _tick_forever(self) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), timeout=self.settings.tick_s)
            if self.stopping.is_set():
                return
            try:
                await self.tick()
            except (RegistryError, RedisError, NatsError) as exc:
                # Redis or NATS away for a moment: the next tick tries again (a scheduler
                # that cannot renew its lease meanwhile steps down on its own).
                log.warning("tick_failed", error=str(exc))

    async def tick(self) -> None:
        now = time.time()
        self._ticks += 1
        ingest = self.ingest
        await ingest.scan_registry()
        for wid in self.pool.silent(now):
            await ingest.gone(wid, reason="silent")
        for gpu_id in self.pool.boot_overdue(now):
            await ingest.gone(gpu_id, reason="boot_timeout")
        await self.follow_pool_limits()
        self.executor.releases.retry_due(now)
        if now - self._profiles_at > self.settings.profile_refresh_s:
            self.refresh_profiles()
        if self._ticks % self.settings.reconcile_ticks == 0:
            await ingest.reconcile()
        await self.step(Event(now, EventKind.TICK))
        await self._publish_status(now)

    async def follow_pool_limits(self) -> None:
        """The provisioner's pool limits as they are now: they change while the scheduler
        leads (a provisioner that starts after the election writes its own over an earlier
        run's), so the core follows them every tick rather than once at the takeover."""
        limits = await self.ctx.registry.pool_limits()
        if limits is None:
            return
        wanted = (limits.min_workers, limits.max_workers)
        if wanted == self.limits:
            return
        try:
            self.core.set_limits(*wanted)
        except ValueError as exc:
            log.warning("pool_limits_unusable", error=str(exc))
            return
        log.info(
            "pool_limits_followed",
            min_workers=wanted[0],
            max_workers=wanted[1],
            was=list(self.limits) if self.limits else None,
        )
        self.limits = wanted

    def refresh_profiles(self, force: bool = False) -> None:
        """The latency model per kind from what the workers of that kind measure."""
        self._profiles_at = time.time()
        current = self.core.view.profiles
        for kind, beats in self._beats_by_kind().items():
            fallback = self.fallback.get(kind) or self.fallback[self.default_kind]
            try:
                profile = live_profile(kind, beats, fallback)
            except ProfileError as exc:
                log.warning("profile_unusable", gpu_kind=kind, error=str(exc))
                continue
            old = current.get(kind)
            if force or old is None or differs(old, profile):
                self.core.set_profile(kind, profile)
                log.info(
                    "profile_set",
                    gpu_kind=kind,
                    name=profile.name,
                    k=profile.capacity,
                    chunk_ms_1=round(profile.chunk_ms(1), 1),
                    deadline_ms=profile.deadline_ms,
                    migration_ms=round(profile.migration_per_session_ms, 2),
                )

    def _beats_by_kind(self) -> dict[str, list[Heartbeat]]:
        """The latest heartbeats of the known workers, by their kind."""
        out: dict[str, list[Heartbeat]] = {}
        beats = self.ingest.beats
        for wid, worker in self.pool.workers.items():
            beat = beats.get(wid)
            if beat is not None:
                out.setdefault(worker.kind, []).append(beat)
        return out

    async def _publish_status(self, now: float) -> None:
        view = self.core.view
        states = list(view.gpus.values())
        rho_hat, delta = self.core.current_rho_hat(now)
        status: dict[str, Any] = {
            "leader": self.settings.scheduler_id,
            "term": self.lease.term,
            "policy": self.settings.policy,
            "rho_max": round(self.core.rho_max(), 4),
            "rho_hat": rho_hat,
            "delta": delta,
            "gpus": view.billed_gpus,
            "ready": sum(1 for s in states if s is GpuState.READY),
            "booting": sum(1 for s in states if s is GpuState.BOOTING),
            "draining": sum(1 for s in states if s is GpuState.DRAINING),
            # Drained by an operator and kept: not in the autoscaler's count, never released.
            "cordoned": sorted(view.cordoned),
            "active_sessions": view.active_sessions,
            "pending": len(view.pending),
            "idle_sessions": len(view.idle_sessions),
            "updated_at": now,
            # Given back by the core, still running: a release being retried.
            "releasing": len(self.pool.unreleased),
        }
        status["rho"] = {
            gpu: round(view.load(gpu) / max(1, view.capacity_of(gpu)), 4) for gpu in view.gpus
        }
        status["deadline_ms"] = view.profile.deadline_ms
        # What `turboserve replay --compare-sim` needs to simulate the same pool: the latency
        # model per kind (as measured), the default kind, the boot delay, the limits, the tick.
        status["profiles"] = {kind: p.to_dict() for kind, p in view.profiles.items()}
        status["gpu_kind"] = self.default_kind
        status["boot_delay_s"] = self.core.boot_delay_s
        status["tick_s"] = self.settings.tick_s
        self.metrics.observe_view(status)
        await self.ctx.registry.raise_counter("peak_gpus", view.billed_gpus)
        await self.ctx.registry.set_scheduler_status(
            status, ttl_s=max(3.0, 4 * self.settings.tick_s)
        )


def _trigger(fact: Input) -> tuple[str, str | None, str | None]:
    """What a decision's log line names as its trigger: an event's kind, or a fact's, and the
    session and GPU it is about."""
    name = type(fact).__name__
    if isinstance(fact, Event):
        return str(fact.kind), fact.session_id, fact.gpu_id
    # Named by the policy's event they step: the trigger operators look for.
    if isinstance(fact, WorkerJoined):
        return str(EventKind.GPU_READY), None, fact.gpu_id
    if isinstance(fact, GpuRefused):
        return str(EventKind.GPU_GONE), None, fact.gpu_id
    if isinstance(fact, WorkerHeard):
        return name, None, fact.seen.worker_id
    if isinstance(fact, ParkedStateMoved):
        return name, fact.session_id, fact.dst
    if isinstance(fact, MoveEnded):
        return name, fact.session_id, fact.owner
    return name, None, None

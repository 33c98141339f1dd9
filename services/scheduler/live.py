"""The live scheduler: the policy core fed from NATS and Redis, its decisions carried out.

While this scheduler leads, :class:`LiveScheduler` is the thin adapter of the design:

- what it hears becomes the core's events: session events from the durable JetStream consumer
  (created -> ARRIVE, active, idle, closed -> DEPART), worker heartbeats (a worker it did not
  know -> GPU_READY; one that falls silent -> GPU_GONE; an operator's drain -> GPU_DRAIN;
  measured chunk times, slots, period and handoff costs -> the latency profile of its kind),
  provisioner events (ready, gone) and a timer (TICK);
- every decision becomes a command: Assign/Resume/Suspend to workers (ownership first moved
  in the registry by a compare-and-set guarded by this scheduler's lease), Migrate through the
  migration protocol, RequestGpus/Release to the provisioner, Drain to the worker. Commands
  carry the lease's term and are retried until answered; a refused or failed one becomes the
  event the core expects (PLACEMENT_FAILED, MIGRATION_FAILED, GPU_GONE);
- one log line per decision (event, decision, rho_max, rho_hat, GPUs), metrics, and the
  scheduler's view in Redis for operators.

The core stays pure: it never waits; everything here that waits runs in tracked tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import FetchTimeoutError
from redis.exceptions import RedisError

from services.scheduler.commands import CommandSender
from services.scheduler.core.loop import Controller
from services.scheduler.core.types import (
    Assign,
    Decision,
    Drain,
    Event,
    EventKind,
    GpuState,
    Migrate,
    Release,
    RequestGpus,
    RestoredGpu,
    RestoredSession,
    Resume,
    Suspend,
)
from services.scheduler.measured import differs, live_profile
from services.scheduler.metrics import SchedulerMetrics
from shared.leader import Lease
from shared.logging import get_logger
from shared.profile import LatencyProfile, ProfileError
from shared.registry import RegistryError, SessionRecord, WorkerRecord
from shared.runner import ServiceContext, subscriptions_live
from shared.settings import SchedulerSettings
from shared.states import IllegalTransition, SessionState
from shared.streams import SCHEDULER_DURABLE
from shared.wire import (
    Heartbeat,
    MigrationReport,
    ProvisionerCmdKind,
    ProvisionerCommand,
    ProvisionerEvent,
    SessionEvent,
    SessionEventKind,
    WorkerCmdKind,
    WorkerCommand,
    WorkerStatus,
    decode_or_drop,
)

log = get_logger("turboserve.scheduler")

_SESSION_EVENTS = {
    SessionEventKind.CREATED: EventKind.ARRIVE,
    SessionEventKind.ACTIVE: EventKind.ACTIVE,
    SessionEventKind.IDLE: EventKind.IDLE,
    SessionEventKind.CLOSED: EventKind.DEPART,
}
_RECONCILE_EVERY = 4  # ticks
_PROFILE_REFRESH_S = 5.0
_RELEASE_ATTEMPTS = 10
# A release that did not go through (a session still there, a refused stop) is tried again,
# after a pause that doubles from a few ticks up to this.
_RELEASE_RETRY_MAX_S = 60.0


@dataclass
class _Worker:
    """A worker the core knows as a GPU."""

    kind: str
    beat: Heartbeat | None = None
    seen_at: float = field(default_factory=time.time)


class LiveScheduler:
    def __init__(
        self,
        ctx: ServiceContext,
        settings: SchedulerSettings,
        lease: Lease,
        core: Controller,
        fallback: dict[str, LatencyProfile],
        default_kind: str,
        metrics: SchedulerMetrics,
        handoff_timeout_s: float = 30.0,
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.lease = lease
        self.core = core
        self.fallback = fallback
        self.default_kind = default_kind
        self.metrics = metrics
        self.handoff_timeout_s = handoff_timeout_s
        self.core_boot_delay_s = getattr(getattr(core, "config", None), "boot_delay_s", 0.0)
        self.sender = CommandSender(ctx, term=lease.term, reply_timeout_s=settings.command_timeout_s)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subs: list[Any] = []
        self._psub: Any = None
        self._stopping = asyncio.Event()
        self._followups: deque[Event] = deque()
        self.workers: dict[str, _Worker] = {}  # GPUs the core knows (ready or draining)
        self.beats: dict[str, Heartbeat] = {}  # latest heartbeat of every worker heard
        self.booting: dict[str, float] = {}  # requested GPU id -> when
        self.our_drains: set[str] = set()  # drains this scheduler decided (not an operator)
        # GPUs the core gave back whose worker has not stopped yet -> (when to try again,
        # attempts so far); and the release in flight per GPU.
        self.unreleased: dict[str, tuple[float, int]] = {}
        self._releasing: dict[str, asyncio.Task[Any]] = {}
        self._reports: dict[str, asyncio.Future[MigrationReport]] = {}  # by command id
        self._migrations_from: dict[str, set[asyncio.Task[Any]]] = {}
        # Sessions with a Migrate in flight -> how many: the core already has them on the
        # destination while the registry names the source until the commit.
        self._moving: dict[str, int] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._ticks = 0
        self._profiles_at = 0.0
        self._rebuilt = False  # until then, heartbeats are only recorded (restore comes first)
        self._loops: list[asyncio.Task[Any]] = []
        self._heard: dict[str, float] = {}  # when each worker's last NATS heartbeat came

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        ctx = self.ctx
        self._subs.append(await ctx.nc.subscribe(ctx.subjects.worker_heartbeat, cb=self._on_beat))
        self._subs.append(await ctx.nc.subscribe(ctx.subjects.provisioner_events,
                                                 cb=self._on_pool_event))
        self._subs.append(await ctx.nc.subscribe(ctx.subjects.migrations, cb=self._on_report))
        await subscriptions_live(ctx.nc)
        await asyncio.sleep(min(1.5, self.settings.worker_timeout_s / 2))  # hear the heartbeats
        await self.rebuild()
        self._psub = await ctx.js.pull_subscribe(
            ctx.subjects.session_events, durable=SCHEDULER_DURABLE,
            stream=ctx.subjects.sessions_stream)
        # The two loops are supervised by the service: one that fails takes the scheduler down
        # (a standby takes over) rather than leaving a leader that no longer decides.
        self._loops = [self.ctx.spawn(self._consume(), name="scheduler-events"),
                       self.ctx.spawn(self._tick_forever(), name="scheduler-tick")]
        log.info("scheduler_leading", term=self.lease.term, gpus=len(self.workers))

    async def stop(self) -> None:
        """Stop deciding (leadership lost or shutdown); commands in flight end or are dropped."""
        self._stopping.set()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        for loop in self._loops:
            loop.cancel()
        if self._loops:
            await asyncio.wait(self._loops, timeout=5.0)
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._psub is not None:
            psub, self._psub = self._psub, None
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduler_task_failed", task=task.get_name(), error=repr(task.exception()),
                      exc_info=task.exception())

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
            self.workers[w.id] = _Worker(w.gpu_kind, self.beats.get(w.id))
        live = {g.gpu_id for g in gpus}
        sessions = []
        for sid, owner in (await registry.placement()).items():
            record = await registry.get_session(sid)
            if record is None or record.state is SessionState.TERMINATED:
                continue
            if record.state is SessionState.SUSPENDED:
                sessions.append(RestoredSession(sid, active=False, in_host_ram=owner in live))
            else:
                sessions.append(RestoredSession(sid, active=True,
                                                gpu_id=owner if owner in live else None))
        for sid in await registry.pending_sessions():
            sessions.append(RestoredSession(sid, active=True))
        self._refresh_profiles(force=True)
        self.core.restore(gpus, sessions, now)
        self._rebuilt = True
        log.info("scheduler_view_rebuilt", gpus=len(gpus), sessions=len(sessions))
        await self.step(Event(now, EventKind.TICK))

    # -- one step of the core -------------------------------------------------------------------
    async def step(self, event: Event) -> None:
        async with self._lock:
            await self._step_locked(event)

    async def _step_locked(self, event: Event) -> None:
        """``step`` for a caller that holds the step lock already."""
        self._followups.append(event)
        while self._followups:
            current = self._followups.popleft()
            started = time.perf_counter()
            decisions = self.core.step(current)
            self.metrics.decision_seconds.observe(time.perf_counter() - started)
            if decisions:
                rho_max = self.core.rho_max()
                rho_hat, _ = self.core.current_rho_hat(current.t)
                gpus = self.core.view.billed_gpus
                for decision in decisions:
                    self.metrics.decisions.labels(type(decision).__name__).inc()
                    log.info("decision", trigger=str(current.kind), session_id=current.session_id,
                             gpu_id=current.gpu_id, decision=_describe(decision),
                             rho_max=round(rho_max, 3), rho_hat=rho_hat, gpus=gpus)
                    await self._execute(decision)

    def _feed(self, event: Event) -> None:
        """An event found while carrying out a decision: stepped right after (under the lock)."""
        self._followups.append(event)

    async def _feed_later(self, event: Event) -> None:
        """An event from a background task: a step of its own."""
        if not self._stopping.is_set():
            await self.step(event)

    async def _execute(self, decision: Decision) -> None:
        try:
            if isinstance(decision, Assign):
                await self._assign(decision.session_id, decision.gpu_id)
            elif isinstance(decision, Resume):
                await self._resume(decision.session_id, decision.gpu_id)
            elif isinstance(decision, Suspend):
                await self._suspend(decision.session_id, decision.gpu_id)
            elif isinstance(decision, Migrate):
                sid = decision.session_id
                self._moving[sid] = self._moving.get(sid, 0) + 1
                task = self._spawn(self._migrate(sid, decision.src, decision.dst),
                                   f"migrate-{sid}")
                self._migrations_from.setdefault(decision.src, set()).add(task)
                task.add_done_callback(self._migrations_from[decision.src].discard)
                task.add_done_callback(lambda _t, sid=sid: self._moved(sid))
            elif isinstance(decision, RequestGpus):
                now = time.time()
                for gpu_id in decision.gpu_ids:
                    self.booting[gpu_id] = now
                self._spawn(self._request(list(decision.gpu_ids), decision.kind), "request-gpus")
                self.metrics.scale_events.labels("out").inc()
                # Counted as decisions, as the simulator counts them; the provisioner records
                # each worker it starts or stops as a cluster event.
                await self.ctx.registry.bump_counters(scale_out_events=1)
            elif isinstance(decision, Drain):
                self.our_drains.add(decision.gpu_id)
                self._spawn(self._drain(decision.gpu_id), f"drain-{decision.gpu_id}")
            elif isinstance(decision, Release):
                # It stays a known worker until the provisioner reports it gone.
                self.booting.pop(decision.gpu_id, None)
                self.unreleased[decision.gpu_id] = (math.inf, 0)
                self._start_release(decision.gpu_id)
                self.metrics.scale_events.labels("in").inc()
                await self.ctx.registry.bump_counters(scale_in_events=1)
        except RegistryError as exc:  # GuardFailed included: the lease is gone
            log.warning("decision_not_carried_out", decision=_describe(decision), error=str(exc))

    # -- sessions -------------------------------------------------------------------------------
    def _alive(self, worker_id: str | None) -> bool:
        return worker_id is not None and worker_id in self.workers

    async def _assign(self, sid: str, gpu: str) -> None:
        registry = self.ctx.registry
        record = await registry.get_session(sid)
        if record is None or record.state is SessionState.TERMINATED:
            self._feed(Event(time.time(), EventKind.DEPART, session_id=sid))
            return
        if record.state is SessionState.SUSPENDED and self._alive(record.owner):
            await self._resume(sid, gpu)  # its state is parked on a worker: resume it there
            return
        if record.state is not SessionState.PENDING:
            if record.owner == gpu and record.state is SessionState.EXECUTING:
                return  # already there
            if self._alive(record.owner):
                # The core's view was behind: the session runs elsewhere. Repair the view.
                self._feed(Event(time.time(), EventKind.MIGRATION_FAILED, session_id=sid,
                                 gpu_id=record.owner))
                return
            record = await self._requeue(record)
            if record is None:
                return
        try:
            claimed = await registry.claim(sid, gpu, record.epoch, guard=self.guard)
        except (IllegalTransition, RegistryError) as exc:
            log.info("claim_lost", session_id=sid, gpu_id=gpu, reason=str(exc))
            return
        cmd = WorkerCommand(kind=WorkerCmdKind.ASSIGN, worker_id=gpu, epoch=claimed.epoch,
                            session_id=sid, prompt=claimed.prompt, seed=claimed.seed,
                            seq=claimed.last_seq + 1, token_hash=claimed.token_hash,
                            owner_key=claimed.owner_key)
        self._spawn(self._deliver(sid, cmd, on_failure=EventKind.PLACEMENT_FAILED), f"assign-{sid}")

    async def _requeue(self, record: SessionRecord) -> SessionRecord | None:
        """Back to pending (its worker is gone): the registry's half of a re-placement."""
        try:
            return await self.ctx.registry.transition(
                record.id, SessionState.PENDING, expected_epoch=record.epoch, owner=None,
                guard=self.guard)
        except (IllegalTransition, RegistryError) as exc:
            log.info("requeue_skipped", session_id=record.id, reason=str(exc))
            return None

    async def _suspend(self, sid: str, gpu: str) -> None:
        record = await self.ctx.registry.get_session(sid)
        if record is None:
            return
        if sid in self._moving or record.state is SessionState.MIGRATING:
            # The core moved it when it decided; the registry names the source until the
            # handoff commits. Dropping the suspend would leave it running where it lands,
            # unwatched and holding a slot the core counts free: suspend it there instead.
            self._spawn(self._suspend_after_move(sid), f"suspend-{sid}")
            return
        if record.owner != gpu or record.state is not SessionState.EXECUTING:
            return
        self._spawn(self._deliver(sid, await self._suspend_command(record)), f"suspend-{sid}")

    async def _suspend_command(self, record: SessionRecord) -> WorkerCommand:
        """Mark an executing session suspended and the SUSPEND for its owner. Idle/active flips
        keep the epoch: the worker keeps the session (no fencing needed), and the commands to
        it are sent in order."""
        record = await self.ctx.registry.transition(
            record.id, SessionState.SUSPENDED, expected_epoch=record.epoch, bump_epoch=False,
            guard=self.guard)
        assert record.owner is not None
        return WorkerCommand(kind=WorkerCmdKind.SUSPEND, worker_id=record.owner,
                             epoch=record.epoch, session_id=record.id)

    async def _suspend_after_move(self, sid: str) -> None:
        """The suspend of a session whose migration was in flight, once that has ended, on
        the worker that holds it then; nothing if it became active again meanwhile."""
        deadline = time.monotonic() + self.handoff_timeout_s + 10.0
        while time.monotonic() < deadline and not self._stopping.is_set():
            if sid not in self._moving:  # then the registry: a parked state's move
                record = await self.ctx.registry.get_session(sid)
                if record is None or record.state is not SessionState.MIGRATING:
                    break
            await asyncio.sleep(0.05)
        async with self._lock:  # in order with the decisions that follow
            if not self.core.view.is_idle(sid):
                return
            record = await self.ctx.registry.get_session(sid)
            if (record is None or record.state is not SessionState.EXECUTING
                    or not self._alive(record.owner)):
                return
            cmd = await self._suspend_command(record)
        await self._deliver(sid, cmd)

    async def _resume(self, sid: str, gpu: str) -> None:
        record = await self.ctx.registry.get_session(sid)
        if record is None or record.state is SessionState.TERMINATED:
            self._feed(Event(time.time(), EventKind.DEPART, session_id=sid))
            return
        if record.state is SessionState.EXECUTING and record.owner == gpu:
            return
        if record.state is SessionState.SUSPENDED and self._alive(record.owner):
            if record.owner == gpu:
                record = await self.ctx.registry.transition(
                    sid, SessionState.EXECUTING, expected_epoch=record.epoch, bump_epoch=False,
                    guard=self.guard)
                cmd = WorkerCommand(kind=WorkerCmdKind.RESUME, worker_id=gpu, epoch=record.epoch,
                                    session_id=sid)
                self._spawn(self._deliver(sid, cmd, on_failure=EventKind.PLACEMENT_FAILED),
                            f"resume-{sid}")
            else:  # its state is parked on another worker: move it there, then resume
                self._spawn(self._move_then_resume(sid, record.owner, gpu), f"resume-{sid}")
            return
        if record.state is SessionState.MIGRATING:
            self._feed(Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid, gpu_id=gpu))
            return
        await self._assign(sid, gpu)  # its state is gone: placed anew (its worker says so)

    async def _move_then_resume(self, sid: str, src: str | None, dst: str) -> None:
        assert src is not None
        report = await self._run_migration(sid, src, dst)
        if report is None or not report.ok:
            await self._feed_later(Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid,
                                         gpu_id=dst))
            return
        async with self._lock:
            if self.core.view.is_idle(sid):
                return  # paused again while its state moved: it stays suspended where it is
            record = await self.ctx.registry.get_session(sid)
            if record is None or record.owner != dst or record.state is not SessionState.SUSPENDED:
                return
            record = await self.ctx.registry.transition(
                sid, SessionState.EXECUTING, expected_epoch=record.epoch, bump_epoch=False,
                guard=self.guard)
        cmd = WorkerCommand(kind=WorkerCmdKind.RESUME, worker_id=dst, epoch=record.epoch,
                            session_id=sid)
        await self._deliver(sid, cmd, on_failure=EventKind.PLACEMENT_FAILED)

    async def _deliver(self, sid: str, cmd: WorkerCommand,
                       on_failure: EventKind | None = None) -> None:
        """Send one session's command, in order with its others; a refusal or silence that
        leaves the session nowhere becomes ``on_failure`` (with the registry put right)."""
        lock = self._session_locks.setdefault(sid, asyncio.Lock())
        async with lock:
            outcome = await self.sender.to_worker(cmd, superseded=self._superseded(sid, cmd.epoch))
        if outcome.ok or outcome.code in ("superseded",) or outcome.why == "superseded":
            return
        log.warning("command_failed", kind=str(cmd.kind), worker_id=cmd.worker_id,
                    session_id=sid, code=outcome.code, why=outcome.why)
        if on_failure is None or outcome.code == "stale_epoch":
            return
        if cmd.kind is WorkerCmdKind.ASSIGN:
            record = await self.ctx.registry.get_session(sid)
            if record is not None and record.owner == cmd.worker_id and record.epoch == cmd.epoch:
                await self._requeue(record)
        await self._feed_later(Event(time.time(), on_failure, session_id=sid, gpu_id=cmd.worker_id))

    def _superseded(self, sid: str, epoch: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            record = await self.ctx.registry.get_session(sid)
            return record is None or record.epoch != epoch or record.state is SessionState.TERMINATED

        return check

    async def _stop_session(self, sid: str) -> None:
        record = await self.ctx.registry.get_session(sid)
        if record is None or record.owner is None:
            return
        cmd = WorkerCommand(kind=WorkerCmdKind.STOP, worker_id=record.owner, epoch=record.epoch,
                            session_id=sid)
        await self.sender.to_worker(cmd)
        self._session_locks.pop(sid, None)

    async def _forward_prompt(self, event: SessionEvent) -> None:
        record = await self.ctx.registry.get_session(event.session_id)
        if record is None or record.owner is None or record.state not in (
                SessionState.EXECUTING, SessionState.SUSPENDED):
            return  # a pending session starts with the registry's (new) prompt
        cmd = WorkerCommand(kind=WorkerCmdKind.PROMPT, worker_id=record.owner, epoch=record.epoch,
                            session_id=event.session_id, prompt=event.prompt or record.prompt)
        await self._deliver(event.session_id, cmd)

    # -- migrations -----------------------------------------------------------------------------
    def _moved(self, sid: str) -> None:
        left = self._moving.get(sid, 0) - 1
        if left > 0:
            self._moving[sid] = left
        else:
            self._moving.pop(sid, None)

    async def _migrate(self, sid: str, src: str, dst: str) -> None:
        report = await self._run_migration(sid, src, dst)
        if report is not None and report.ok:
            return
        record = await self.ctx.registry.get_session(sid)
        where = record.owner if record is not None and record.owner else src
        if record is not None and record.owner == dst:
            return  # the report was lost, the migration was not
        await self._feed_later(Event(time.time(), EventKind.MIGRATION_FAILED, session_id=sid,
                                     gpu_id=where))

    async def _run_migration(self, sid: str, src: str, dst: str) -> MigrationReport | None:
        record = await self.ctx.registry.get_session(sid)
        if record is None or record.owner != src or record.state not in (
                SessionState.EXECUTING, SessionState.SUSPENDED):
            return None
        cmd = self.sender.stamp(WorkerCommand(kind=WorkerCmdKind.MIGRATE, worker_id=src,
                                              session_id=sid, epoch=record.epoch, target=dst))
        waiter: asyncio.Future[MigrationReport] = asyncio.get_running_loop().create_future()
        self._reports[cmd.command_id] = waiter
        try:
            outcome = await self.sender.to_worker(cmd, superseded=self._superseded(sid, cmd.epoch))
            if not outcome.ok:
                self.metrics.migrations.labels("refused").inc()
                return None
            try:
                report = await asyncio.wait_for(waiter, self.handoff_timeout_s + 10.0)
            except TimeoutError:
                self.metrics.migrations.labels("unreported").inc()
                return None
        finally:
            self._reports.pop(cmd.command_id, None)
        self.metrics.migrations.labels("ok" if report.ok else "failed").inc()
        return report

    async def _on_report(self, msg: Any) -> None:
        report = decode_or_drop(msg.subject, msg.data, MigrationReport, log)
        if report is None:
            return
        waiter = self._reports.get(report.command_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(report)

    # -- the pool -------------------------------------------------------------------------------
    async def _request(self, gpu_ids: list[str], kind: str) -> None:
        reply = await self.sender.to_provisioner(ProvisionerCommand(
            kind=ProvisionerCmdKind.START, count=len(gpu_ids), worker_ids=gpu_ids, gpu_kind=kind))
        if reply is None:
            log.warning("provisioner_unanswered", requested=gpu_ids)
            return  # booting until they come, or time out
        for refusal in reply.refused:
            if refusal.worker_id and self.booting.pop(refusal.worker_id, None) is not None:
                log.warning("gpu_refused", gpu_id=refusal.worker_id, code=refusal.code,
                            detail=refusal.detail)
                await self._feed_later(Event(time.time(), EventKind.GPU_GONE,
                                             gpu_id=refusal.worker_id))

    async def _drain(self, gpu: str) -> None:
        await self.sender.to_worker(WorkerCommand(kind=WorkerCmdKind.DRAIN, worker_id=gpu))

    async def _patiently(self, action: Callable[[str], Awaitable[bool]], arg: str,
                         attempts: int = 10) -> bool:
        """Carry out ``action(arg)`` through Redis or NATS being away for a while (a release
        must not be lost: the worker would run on, known to nobody); what it returned, or
        False when it never got through."""
        for attempt in range(attempts):
            try:
                return await action(arg)
            except (RedisError, NatsError) as exc:
                log.warning("action_retry", action=action.__name__, arg=arg, attempt=attempt + 1,
                            error=str(exc))
                await asyncio.sleep(min(5.0, 0.5 * 2 ** attempt))
        log.error("action_abandoned", action=action.__name__, arg=arg)
        return False

    def _start_release(self, gpu: str) -> None:
        """Give ``gpu`` back in the background, unless that is already under way."""
        if gpu in self._releasing:
            return
        task = self._spawn(self._give_back(gpu), f"release-{gpu}")
        self._releasing[gpu] = task
        task.add_done_callback(lambda _t, gpu=gpu: self._releasing.pop(gpu, None))

    async def _give_back(self, gpu: str) -> None:
        """One attempt at releasing ``gpu``; when it does not go through, the next is due
        after a pause (``_retry_releases``) for as long as the worker runs and the core does
        not take it back. The core has already left it out of the pool: a release given up
        on would leave a worker running, paid for and used by nobody."""
        if await self._patiently(self._release, gpu):
            self.unreleased.pop(gpu, None)
            return
        if gpu not in self.unreleased:
            return  # gone meanwhile, or the core took it back
        attempts = self.unreleased[gpu][1] + 1
        pause = min(_RELEASE_RETRY_MAX_S, max(1.0, 4 * self.settings.tick_s) * 2 ** (attempts - 1))
        self.unreleased[gpu] = (time.time() + pause, attempts)
        log.warning("release_pending", gpu_id=gpu, attempts=attempts, retry_in_s=round(pause, 1))

    def _retry_releases(self, now: float) -> None:
        for gpu, (due, _) in list(self.unreleased.items()):
            if gpu not in self.workers or self.core.view.state_of(gpu) is not None:
                # Gone (or not up: ``_ready`` gives it back if it comes), or the core holds
                # it again (a failed evacuation): no longer a release to finish.
                if gpu not in self._releasing:
                    self.unreleased.pop(gpu, None)
            elif due <= now:
                self._start_release(gpu)

    async def _release(self, gpu: str) -> bool:
        """Give a GPU back: after the migrations off it, and after moving the idle sessions
        parked in its host memory to another worker; the provisioner stops it. True once the
        provisioner takes the stop; False while something holds it here (tried again)."""
        moving = list(self._migrations_from.get(gpu, ()))
        if moving:
            await asyncio.wait(moving)
        registry = self.ctx.registry
        for sid, owner in (await registry.placement()).items():
            if owner != gpu:
                continue
            record = await registry.get_session(sid)
            if record is None or record.state is not SessionState.SUSPENDED:
                continue
            target = self._parking_for(gpu)
            if target is None:
                log.warning("release_blocked", gpu_id=gpu, reason="nowhere to move idle sessions")
                return False
            report = await self._run_migration(sid, gpu, target)
            if report is None or not report.ok:
                log.warning("release_blocked", gpu_id=gpu, session_id=sid,
                            reason="an idle session could not move")
                return False
        left = [sid for sid, owner in (await registry.placement()).items() if owner == gpu]
        if left:
            log.warning("release_blocked", gpu_id=gpu, sessions=left)
            return False
        for _ in range(_RELEASE_ATTEMPTS):
            reply = await self.sender.to_provisioner(ProvisionerCommand(
                kind=ProvisionerCmdKind.STOP, worker_ids=[gpu]))
            codes = [] if reply is None else [r.code for r in reply.refused]
            if reply is not None and reply.ok:
                self.our_drains.discard(gpu)
                return True
            log.warning("release_refused", gpu_id=gpu, refused=codes)
            if "not_drained" not in codes:  # its heartbeat may lag the last migration: retry
                return False
            await asyncio.sleep(self.settings.tick_s * 2)
        return False

    def _parking_for(self, leaving: str) -> str | None:
        """The ready GPU with the fewest sessions parked, for idle sessions of one leaving."""
        view = self.core.view
        best: tuple[int, str] | None = None
        for gpu_id, state in view.gpus.items():
            if gpu_id == leaving or state is not GpuState.READY or gpu_id not in self.workers:
                continue
            beat = self.beats.get(gpu_id)
            parked = len(beat.suspended) if beat is not None else 0
            if best is None or (parked, gpu_id) < best:
                best = (parked, gpu_id)
        return None if best is None else best[1]

    # -- what it hears --------------------------------------------------------------------------
    async def _consume(self) -> None:
        while not self._stopping.is_set():
            psub = self._psub
            if psub is None:
                return
            try:
                msgs = await psub.fetch(batch=32, timeout=1.0)
            except (TimeoutError, FetchTimeoutError, NatsTimeout):
                continue
            except NatsError as exc:  # NATS reconnecting: the durable consumer waits for us
                log.warning("events_fetch_failed", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                event = decode_or_drop(msg.subject, msg.data, SessionEvent, log)
                try:
                    if event is None:
                        await msg.term()  # never redeliver garbage
                        continue
                    await self.on_session_event(event)
                    await msg.ack()
                except (RedisError, NatsError) as exc:
                    # Not acked: JetStream delivers the event again (the core tolerates a
                    # repeated event), and the registry's pending set backs it up.
                    log.warning("event_not_handled", session_id=event and event.session_id,
                                error=repr(exc))

    async def on_session_event(self, event: SessionEvent) -> None:
        if event.kind is SessionEventKind.PROMPT:
            self._spawn(self._forward_prompt(event), f"prompt-{event.session_id}")
            return
        if event.kind is SessionEventKind.CLOSED:
            self._spawn(self._stop_session(event.session_id), f"stop-{event.session_id}")
        await self.step(Event(time.time(), _SESSION_EVENTS[event.kind], session_id=event.session_id))

    async def _on_beat(self, msg: Any) -> None:
        beat = decode_or_drop(msg.subject, msg.data, Heartbeat, log)
        if beat is None:
            return
        self.beats[beat.worker_id] = beat
        self._heard[beat.worker_id] = time.time()
        if not self._rebuilt:
            return
        wid = beat.worker_id
        known = self.workers.get(wid)
        if known is not None:
            known.beat, known.seen_at = beat, time.time()
            if (beat.status is WorkerStatus.DRAINING and wid not in self.our_drains
                    and self.core.view.state_of(wid) is GpuState.READY):
                mode = (await self.ctx.registry.operator_drains()).get(wid, "hold")
                await self._follow_operator_drain(wid, mode)
            return
        if beat.status is WorkerStatus.READY:
            await self._ready(wid, beat.gpu_kind)

    async def _on_pool_event(self, msg: Any) -> None:
        event = decode_or_drop(msg.subject, msg.data, ProvisionerEvent, log)
        if event is None or not self._rebuilt:
            return  # a worker that came meanwhile is in the registry, which rebuild reads
        if event.status is WorkerStatus.READY and event.worker_id not in self.workers:
            await self._ready(event.worker_id, event.gpu_kind or self.default_kind)
        elif event.status is WorkerStatus.GONE:
            await self._gone(event.worker_id, reason=event.code or "gone")

    async def _ready(self, wid: str, kind: str) -> None:
        if wid in self.workers:
            return
        self.booting.pop(wid, None)
        self.workers[wid] = _Worker(kind, self.beats.get(wid))
        self._refresh_profiles(force=True)
        await self.step(Event(time.time(), EventKind.GPU_READY, gpu_id=wid, gpu_kind=kind))
        if wid in self.workers and self.core.view.state_of(wid) is None:
            # The core does not take it: one it gave back (or gave up on) while it booted,
            # which came up all the same. Stop it rather than pay for it unused.
            log.warning("gpu_ready_after_release", gpu_id=wid)
            self.unreleased.setdefault(wid, (0.0, 0))
            self._start_release(wid)

    async def _gone(self, wid: str, reason: str) -> None:
        was_known = self.workers.pop(wid, None) is not None
        was_booting = self.booting.pop(wid, None) is not None
        self.beats.pop(wid, None)
        self.our_drains.discard(wid)
        self.unreleased.pop(wid, None)
        if not (was_known or was_booting):
            return
        log.warning("gpu_gone", gpu_id=wid, reason=reason)
        registry = self.ctx.registry
        for sid, owner in (await registry.placement()).items():
            if owner == wid:
                record = await registry.get_session(sid)
                if record is not None and record.owner == wid:
                    await self._requeue(record)
        await self.step(Event(time.time(), EventKind.GPU_GONE, gpu_id=wid))
        await registry.clear_operator_drain(wid)
        # Every view (ctl, /v1/cluster, the dashboard) shows it lost, then forgets it; a
        # worker that stopped cleanly removed its record already, and stays removed.
        await registry.mark_worker_lost(wid, self.settings.lost_worker_shown_s)

    # -- the timer ------------------------------------------------------------------------------
    async def _tick_forever(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=self.settings.tick_s)
            if self._stopping.is_set():
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
        await self._scan_registry()
        for wid, worker in list(self.workers.items()):
            beat = self.beats.get(wid)
            last = beat.at if beat is not None else worker.seen_at
            if now - max(last, worker.seen_at) > self.settings.worker_timeout_s:
                await self._gone(wid, reason="silent")
        for gpu_id, since in list(self.booting.items()):
            if now - since > self.settings.boot_timeout_s:
                await self._gone(gpu_id, reason="boot_timeout")
        self._retry_releases(now)
        if now - self._profiles_at > _PROFILE_REFRESH_S:
            self._refresh_profiles()
        if self._ticks % _RECONCILE_EVERY == 0:
            await self.reconcile()
        await self.step(Event(now, EventKind.TICK))
        await self._publish_status(now)

    async def _scan_registry(self) -> None:
        """Workers as the registry sees them (a heartbeat missed on NATS is still in Redis): a
        ready one the core does not know joins, a known one whose record expired is gone."""
        records = {w.id: w for w in await self.ctx.registry.workers()}
        await self._follow_operator_drains(records)
        now = time.time()
        for wid in list(self.workers):
            record = records.get(wid)
            heard = now - self._heard.get(wid, 0.0) < self.settings.worker_timeout_s
            if (record is None or not record.alive) and not heard:
                # Gone from the registry and silent on NATS too (a worker heard on NATS whose
                # record is missing is one Redis lost: it writes it back at its next beat).
                await self._gone(wid, reason="expired")
        for wid, record in records.items():
            if (wid not in self.workers and not record.alive
                    and record.status is not WorkerStatus.LOST
                    and now - max(record.updated_at, self._heard.get(wid, 0.0))
                    > self.settings.worker_timeout_s):
                # Silent, and never (or no longer) in the core's pool: a worker that died
                # while no scheduler led, or before it was ready. Shown lost, then forgotten.
                log.warning("worker_record_lost", gpu_id=wid, status=str(record.status))
                await self.ctx.registry.mark_worker_lost(wid, self.settings.lost_worker_shown_s)
                continue
            if wid in self.workers or not record.alive or record.status is not WorkerStatus.READY:
                continue
            if wid not in self.beats:
                self.beats[wid] = Heartbeat(
                    worker_id=wid, status=record.status, capacity=record.capacity,
                    active=record.active, sessions=list(record.sessions), device=record.device,
                    chunk_ms=dict(record.chunk_ms), gpu_kind=record.gpu_kind,
                    at=record.updated_at)
            await self._ready(wid, record.gpu_kind)

    async def _follow_operator_drains(self, records: dict[str, WorkerRecord]) -> None:
        """An operator's drains as ``turboserve ctl`` records them: ``hold`` cordons the GPU
        (emptied, kept out of placement and of the autoscaler's count, never released), ``stop``
        drains it to be given back; a cordoned GPU whose worker is ready again and no longer
        held (``ctl undrain``) is uncordoned. A worker found draining that nobody recorded
        and this scheduler did not drain is an operator's too: held."""
        drains = await self.ctx.registry.operator_drains()
        view = self.core.view
        for wid in list(self.workers):
            record = records.get(wid)
            mode = drains.get(wid)
            if mode is None and record is not None and record.status is WorkerStatus.DRAINING \
                    and wid not in self.our_drains:
                mode = "hold"
            if mode is not None:
                await self._follow_operator_drain(wid, mode)
            elif (wid in view.cordoned and record is not None
                    and record.status is WorkerStatus.READY):
                log.info("operator_undrain", gpu_id=wid)
                await self.step(Event(time.time(), EventKind.GPU_UNCORDON, gpu_id=wid))

    async def _follow_operator_drain(self, wid: str, mode: str) -> None:
        view = self.core.view
        state = view.state_of(wid)
        cordoned = wid in view.cordoned
        if mode == "stop" and (state is GpuState.READY or cordoned):
            log.info("operator_drain", gpu_id=wid, mode=mode)
            self.our_drains.add(wid)  # the core gives it back once empty
            await self.step(Event(time.time(), EventKind.GPU_DRAIN, gpu_id=wid))
        elif mode == "hold" and not cordoned and state in (GpuState.READY, GpuState.DRAINING):
            log.info("operator_drain", gpu_id=wid, mode=mode)
            self.our_drains.discard(wid)  # the operator's now, even if a scale-in began it
            await self.step(Event(time.time(), EventKind.GPU_CORDON, gpu_id=wid))

    async def reconcile(self) -> None:
        """Repair the core's view where the registry says otherwise: sessions it never heard
        of (a lost event), and sessions placed elsewhere than it thinks."""
        registry = self.ctx.registry
        view = self.core.view
        known = set(view.placement) | set(view.pending) | set(view.idle_sessions)
        pending = await registry.pending_sessions()
        for sid in pending:
            if sid not in known:
                await self.step(Event(time.time(), EventKind.ARRIVE, session_id=sid))
        await self._replace_handed_back(pending)
        placement = await registry.placement()
        for sid, owner in placement.items():
            if sid in known or not self._alive(owner):
                continue
            # A session the core never heard of runs on a worker (written back after Redis
            # restarted empty, say): the core learns it; placing it finds where it is.
            record = await registry.get_session(sid)
            if record is None or record.state not in (SessionState.EXECUTING,
                                                      SessionState.SUSPENDED):
                continue
            await self.step(Event(time.time(), EventKind.ARRIVE, session_id=sid))
            if record.state is SessionState.SUSPENDED:
                await self.step(Event(time.time(), EventKind.IDLE, session_id=sid))
        for sid, gpu in view.placement.items():
            owner = placement.get(sid)
            if sid in self._moving:
                # Not a failure: the core moved it when it decided, the registry follows at the
                # commit; the migration's own outcome corrects the core if it fails. Taking it
                # back now would have the core move it (or others) again, then back.
                continue
            if owner is not None and owner != gpu and self._alive(owner):
                record = await registry.get_session(sid)
                if record is not None and record.state is SessionState.EXECUTING:
                    await self.step(Event(time.time(), EventKind.MIGRATION_FAILED,
                                          session_id=sid, gpu_id=owner))
        # A worker that keeps saying it does not have a session it owns (an assignment it
        # lost): the session goes back to pending and is placed again.
        grace = self.settings.worker_timeout_s
        for sid, owner in placement.items():
            beat = self.beats.get(owner)
            if beat is None or not self._alive(owner) or sid in beat.sessions:
                continue
            record = await registry.get_session(sid)
            if (record is None or record.owner != owner or record.state is not SessionState.EXECUTING
                    or beat.at - record.updated_at < grace):
                continue
            log.warning("session_lost_by_worker", session_id=sid, gpu_id=owner)
            if await self._requeue(record) is not None:
                await self.step(Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid,
                                      gpu_id=owner))

    async def _replace_handed_back(self, pending: list[str]) -> None:
        """Sessions the core has on a GPU that the registry has pending again: a worker that
        found no free slot for an assignment handed it back (it holds a slot until a chunk
        boundary that the core already counts free). Placed again, not on that GPU for the
        backoff, instead of waiting for the viewer's next action. Checked under the step lock,
        so an assignment the core has just decided has claimed the session already."""
        if not pending:
            return
        async with self._lock:
            for sid in pending:
                gpu = self.core.view.gpu_of(sid)
                if gpu is None or sid in self._moving:
                    continue
                record = await self.ctx.registry.get_session(sid)
                if record is not None and record.state is SessionState.PENDING:
                    log.warning("session_handed_back", session_id=sid, gpu_id=gpu)
                    await self._step_locked(Event(time.time(), EventKind.PLACEMENT_FAILED,
                                                  session_id=sid, gpu_id=gpu))

    def _refresh_profiles(self, force: bool = False) -> None:
        """The latency model per kind from what the workers of that kind measure."""
        self._profiles_at = time.time()
        by_kind: dict[str, list[Heartbeat]] = {}
        for wid, worker in self.workers.items():
            beat = self.beats.get(wid)
            if beat is not None:
                by_kind.setdefault(worker.kind, []).append(beat)
        current = self.core.view.profiles
        for kind, beats in by_kind.items():
            fallback = self.fallback.get(kind) or self.fallback[self.default_kind]
            try:
                profile = live_profile(kind, beats, fallback)
            except ProfileError as exc:
                log.warning("profile_unusable", gpu_kind=kind, error=str(exc))
                continue
            old = current.get(kind)
            if force or old is None or differs(old, profile):
                self.core.set_profile(kind, profile)
                log.info("profile_set", gpu_kind=kind, name=profile.name, k=profile.capacity,
                         chunk_ms_1=round(profile.chunk_ms(1), 1),
                         deadline_ms=profile.deadline_ms,
                         migration_ms=round(profile.migration_per_session_ms, 2))

    async def _publish_status(self, now: float) -> None:
        view = self.core.view
        states = list(view.gpus.values())
        rho_hat, delta = self.core.current_rho_hat(now)
        status = {
            "leader": self.settings.scheduler_id, "term": self.lease.term,
            "policy": self.settings.policy,
            "rho_max": round(self.core.rho_max(), 4), "rho_hat": rho_hat, "delta": delta,
            "gpus": view.billed_gpus,
            "ready": sum(1 for s in states if s is GpuState.READY),
            "booting": sum(1 for s in states if s is GpuState.BOOTING),
            "draining": sum(1 for s in states if s is GpuState.DRAINING),
            # Drained by an operator and kept: not in the autoscaler's count, never released.
            "cordoned": sorted(view.cordoned),
            "active_sessions": view.active_sessions, "pending": len(view.pending),
            "idle_sessions": len(view.idle_sessions), "updated_at": now,
            # Given back by the core, still running: a release being retried.
            "releasing": len(self.unreleased),
        }
        status["rho"] = {gpu: round(view.load(gpu) / max(1, view.capacity_of(gpu)), 4)
                         for gpu in view.gpus}
        status["deadline_ms"] = self.core.view.profile.deadline_ms
        # What `turboserve replay --compare-sim` needs to simulate the same pool: the latency
        # model per kind (as measured), the default kind, the boot delay, the limits, the tick.
        status["profiles"] = {kind: p.to_dict() for kind, p in view.profiles.items()}
        status["gpu_kind"] = self.default_kind
        status["boot_delay_s"] = self.core_boot_delay_s
        status["tick_s"] = self.settings.tick_s
        self.metrics.observe_view(status)
        await self.ctx.registry.raise_counter("peak_gpus", view.billed_gpus)
        await self.ctx.registry.set_scheduler_status(status, ttl_s=max(3.0, 4 * self.settings.tick_s))


def _describe(decision: Decision) -> str:
    if isinstance(decision, Assign | Resume | Suspend):
        return f"{type(decision).__name__.lower()} {decision.session_id} -> {decision.gpu_id}"
    if isinstance(decision, Migrate):
        return f"migrate {decision.session_id} {decision.src} -> {decision.dst}"
    if isinstance(decision, RequestGpus):
        return f"request {len(decision.gpu_ids)} {decision.kind} ({', '.join(decision.gpu_ids)})"
    return f"{type(decision).__name__.lower()} {decision.gpu_id}"

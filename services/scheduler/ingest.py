"""The live scheduler's ears: what it hears on NATS and reads in Redis becomes the core's events.

Session events from the durable JetStream consumer (created -> ARRIVE, active, idle, closed ->
DEPART; a prompt is forwarded to the worker), worker heartbeats (a worker it did not know ->
:class:`~services.scheduler.core.pool.WorkerJoined`; one that falls silent -> GPU_GONE; an
operator's drain -> GPU_DRAIN or GPU_CORDON; a known worker's pass boundary and step budget ->
:class:`~services.scheduler.core.pool.WorkerHeard`), provisioner events (ready, gone),
migration reports (to the migration waiting for each), and the registry, read every tick
(workers that joined or expired, operators' drains) and every few ticks to repair the core's
view (:meth:`Ingest.reconcile`). What each of those calls for is the core's to decide
(:class:`~services.scheduler.core.pool.Pool`); the ingest only reads and reports.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import FetchTimeoutError
from redis.exceptions import RedisError

from services.scheduler.core.pool import (
    HandedBack,
    Input,
    Pool,
    WorkerHeard,
    WorkerJoined,
    WorkerPhase,
    WorkerSeen,
)
from services.scheduler.core.types import Event, EventKind
from services.scheduler.executor import Executor, seen
from services.scheduler.unplaced import Unplaced
from shared.logging import get_logger
from shared.registry import Registry, WorkerRecord
from shared.settings import SchedulerSettings
from shared.states import SessionState
from shared.wire import (
    Heartbeat,
    MigrationReport,
    ProvisionerEvent,
    SessionEvent,
    SessionEventKind,
    WorkerStatus,
    decode_or_drop,
    sent_by,
    subject_worker,
)

log = get_logger("turboserve.scheduler")

SESSION_EVENTS = {
    SessionEventKind.CREATED: EventKind.ARRIVE,
    SessionEventKind.ACTIVE: EventKind.ACTIVE,
    SessionEventKind.IDLE: EventKind.IDLE,
    SessionEventKind.CLOSED: EventKind.DEPART,
}
# Session events taken from the durable consumer at once (at most).
FETCH_BATCH = 32


class Steps(Protocol):
    """What the ingest needs of the leadership it serves: a step of the core per fact, the
    latency model refreshed before a worker joins, and tracked tasks."""

    stopping: asyncio.Event

    async def step(self, fact: Input) -> None: ...

    def refresh_profiles(self, force: bool = False) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...


def beat_seen(beat: Heartbeat) -> WorkerSeen:
    """A heartbeat as the core reads it."""
    return WorkerSeen(
        beat.worker_id,
        WorkerPhase(beat.status.value),
        beat.at,
        kind=beat.gpu_kind,
        parked=len(beat.suspended),
        steps=beat.steps,
        full_steps=beat.full_steps,
        min_steps=beat.min_steps,
        pass_ends_at=beat.pass_ends_at,
    )


def record_seen(record: WorkerRecord) -> WorkerSeen:
    """A worker's registry record as the core reads it."""
    return WorkerSeen(
        record.id,
        WorkerPhase(record.status.value),
        record.updated_at,
        kind=record.gpu_kind,
        alive=record.alive,
        parked=len(record.suspended),
        steps=record.steps,
        full_steps=record.full_steps,
    )


def record_beat(record: WorkerRecord) -> Heartbeat:
    """A registry record standing in for a heartbeat not heard yet (the latency model)."""
    return Heartbeat(
        worker_id=record.id,
        status=record.status,
        capacity=record.capacity,
        active=record.active,
        sessions=list(record.sessions),
        device=record.device,
        chunk_ms=dict(record.chunk_ms),
        gpu_kind=record.gpu_kind,
        at=record.updated_at,
    )


class Ingest:
    """Turns what one leadership hears into the core's events."""

    def __init__(
        self,
        shell: Steps,
        pool: Pool,
        executor: Executor,
        registry: Registry,
        settings: SchedulerSettings,
        default_kind: str,
        unplaced: Unplaced | None = None,
    ) -> None:
        self.shell = shell
        # The records of the sessions pending in the registry (written back if Redis loses
        # them): kept by the service, across leaderships.
        self.unplaced = unplaced if unplaced is not None else Unplaced()
        self.pool = pool
        self.executor = executor
        self.registry = registry
        self.settings = settings
        self.default_kind = default_kind
        # The latest heartbeat of every worker heard (or its record until one is): what the
        # latency model is measured from, and which sessions each worker says it holds.
        self.beats: dict[str, Heartbeat] = {}
        self.rebuilt = False  # until then, heartbeats are only recorded (restore comes first)

    # -- NATS -----------------------------------------------------------------------------------
    async def on_beat(self, msg: Any) -> None:
        beat = decode_or_drop(msg.subject, msg.data, Heartbeat, log)
        if beat is None or not sent_by(
            msg.subject, beat.worker_id, subject_worker(msg.subject), log
        ):
            return
        self.beats[beat.worker_id] = beat
        seen = beat_seen(beat)
        known = self.pool.hear(seen, time.time())
        if not self.rebuilt:
            return
        wid = beat.worker_id
        if known:
            # Not a step: a pass boundary changes no decision by itself, and a budget sent
            # again is the one the core set; neither waits for the step lock.
            for decision in self.pool.decide(WorkerHeard(time.time(), seen)):
                await self.executor.execute(decision)
            if self.pool.drained_by_operator(seen):
                mode = (await self.registry.operator_drains()).get(wid, "hold")
                await self._follow_operator_drain(wid, mode)
            return
        if beat.status is WorkerStatus.READY:
            await self.ready(wid, beat.gpu_kind)

    async def on_pool_event(self, msg: Any) -> None:
        event = decode_or_drop(msg.subject, msg.data, ProvisionerEvent, log)
        if event is None or not self.rebuilt:
            return  # a worker that came meanwhile is in the registry, which rebuild reads
        if event.status is WorkerStatus.READY and not self.pool.knows(event.worker_id):
            await self.ready(event.worker_id, event.gpu_kind or self.default_kind)
        elif event.status is WorkerStatus.GONE:
            await self.gone(event.worker_id, reason=event.code or "gone")

    async def on_report(self, msg: Any) -> None:
        report = decode_or_drop(msg.subject, msg.data, MigrationReport, log)
        if report is not None and sent_by(
            msg.subject, report.src, subject_worker(msg.subject), log
        ):
            self.executor.migrations.on_report(report)

    async def consume(self, psub: Any) -> None:
        """Session events from the durable consumer ``psub``, each acked once the core has it."""
        while not self.shell.stopping.is_set():
            try:
                msgs = await psub.fetch(batch=FETCH_BATCH, timeout=1.0)
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
                    log.warning(
                        "event_not_handled", session_id=event and event.session_id, error=repr(exc)
                    )

    async def on_session_event(self, event: SessionEvent) -> None:
        shell, sid = self.shell, event.session_id
        if event.kind is SessionEventKind.PROMPT:
            shell.spawn(
                self.executor.forward_prompt(sid, event.prompt, event.strength), f"prompt-{sid}"
            )
            return
        if event.kind is SessionEventKind.CLOSED:
            self.unplaced.drop(sid)
            shell.spawn(self.executor.stop_session(sid), f"stop-{sid}")
        elif event.kind in (SessionEventKind.CREATED, SessionEventKind.ACTIVE):
            why = await self._not_wanted(sid)
            if why is not None:
                log.info("session_event_outdated", session_id=sid, kind=str(event.kind), why=why)
                return
        await shell.step(Event(time.time(), SESSION_EVENTS[event.kind], session_id=sid))

    async def _not_wanted(self, sid: str) -> str | None:
        """Why a session that an event says is (again) active is not, by the registry and the
        gateways as they are now (None: it is). An event waits in the durable stream until a
        scheduler takes it, so it may come from an earlier run: a session closed since, or
        one that nobody watches any more (its IDLE may have been lost with that run)."""
        record = await self.registry.get_session(sid)
        if record is None or record.state is SessionState.TERMINATED:
            return "closed"
        self.unplaced.note(record)
        if await self.registry.unwatched([sid]):
            return "unwatched"
        return None

    # -- workers joining and leaving ------------------------------------------------------------
    async def ready(self, wid: str, kind: str) -> None:
        if not self.pool.join(wid, kind, time.time()):
            return
        self.shell.refresh_profiles(force=True)
        await self.shell.step(WorkerJoined(time.time(), wid, kind))

    async def gone(self, wid: str, reason: str) -> None:
        if not self.pool.leave(wid):
            return
        self.beats.pop(wid, None)
        log.warning("gpu_gone", gpu_id=wid, reason=reason)
        registry = self.registry
        for sid, owner in (await registry.placement()).items():
            if owner == wid:
                record = await registry.get_session(sid)
                if record is not None and record.owner == wid:
                    await self.executor.requeue(sid, record.epoch)
        await self.shell.step(Event(time.time(), EventKind.GPU_GONE, gpu_id=wid))
        await registry.clear_operator_drain(wid)
        # Every view (ctl, /v1/cluster, the dashboard) shows it lost, then forgets it; a
        # worker that stopped cleanly removed its record already, and stays removed.
        await registry.mark_worker_lost(wid, self.settings.lost_worker_shown_s)

    # -- the registry, every tick ---------------------------------------------------------------
    async def scan_registry(self) -> None:
        """Workers as the registry sees them (a heartbeat missed on NATS is still in Redis): a
        ready one the core does not know joins, a known one whose record expired is gone."""
        found = await self.registry.workers()
        records = [record_seen(w) for w in found]
        await self._follow_operator_drains({r.worker_id: r for r in records})
        now = time.time()
        pool = self.pool
        for wid in pool.expired(records, now):
            await self.gone(wid, reason="expired")
        by_id = {w.id: w for w in found}
        for wid in pool.lost_records(records, now):
            log.warning("worker_record_lost", gpu_id=wid, status=str(by_id[wid].status))
            await self.registry.mark_worker_lost(wid, self.settings.lost_worker_shown_s)
        for wid, kind in pool.joining(records):
            self.beats.setdefault(wid, record_beat(by_id[wid]))
            await self.ready(wid, kind)

    async def _follow_operator_drains(self, records: dict[str, WorkerSeen]) -> None:
        """An operator's drains as ``turboserve ctl`` records them: ``hold`` cordons the GPU
        (emptied, kept out of placement and of the autoscaler's count, never released), ``stop``
        drains it to be given back; a cordoned GPU whose worker is ready again and no longer
        held (``ctl undrain``) is uncordoned."""
        drains = await self.registry.operator_drains()
        pool = self.pool
        for wid in list(pool.workers):
            record = records.get(wid)
            mode = pool.drain_mode(wid, record, drains)
            if mode is not None:
                await self._follow_operator_drain(wid, mode)
                continue
            undrain = pool.undrained(wid, record, time.time())
            if undrain is not None:
                log.info("operator_undrain", gpu_id=wid)
                await self.shell.step(undrain)

    async def _follow_operator_drain(self, wid: str, mode: str) -> None:
        event = self.pool.follow_drain(wid, mode, time.time())
        if event is not None:
            log.info("operator_drain", gpu_id=wid, mode=mode)
            await self.shell.step(event)

    # -- the registry, every few ticks ----------------------------------------------------------
    async def reconcile(self) -> None:
        """Repair the core's view where the registry says otherwise: sessions it never heard
        of (a lost event), sessions placed elsewhere than it thinks, and sessions handed back."""
        shell, registry, pool = self.shell, self.registry, self.pool
        pending = await registry.pending_sessions()
        await self.unplaced.refresh(registry, pending)
        for sid in pool.unheard(pending):
            await shell.step(Event(time.time(), EventKind.ARRIVE, session_id=sid))
        if pending:
            await shell.step(HandedBack(time.time(), tuple(pending)))
        placement = await registry.placement()
        unheard = set(pool.unheard(placement))
        for sid, owner in placement.items():
            if sid not in unheard or not pool.knows(owner):
                continue
            # A session the core never heard of runs on a worker (written back after Redis
            # restarted empty, say): the core learns it; placing it finds where it is.
            record = await registry.get_session(sid)
            if record is None or record.state not in (
                SessionState.EXECUTING,
                SessionState.SUSPENDED,
            ):
                continue
            await shell.step(Event(time.time(), EventKind.ARRIVE, session_id=sid))
            if record.state is SessionState.SUSPENDED:
                await shell.step(Event(time.time(), EventKind.IDLE, session_id=sid))
        for sid, registered in pool.misplaced(placement):
            record = await registry.get_session(sid)
            if record is not None and record.state is SessionState.EXECUTING:
                await shell.step(
                    Event(
                        time.time(), EventKind.MIGRATION_FAILED, session_id=sid, gpu_id=registered
                    )
                )
        await self._requeue_lost_by_workers(placement)

    async def _requeue_lost_by_workers(self, placement: dict[str, str]) -> None:
        """A worker that keeps saying it does not have a session it owns (an assignment it
        lost): the session goes back to pending and is placed again, as the core decides."""
        holding = {wid: beat.sessions for wid, beat in self.beats.items()}
        for sid, owner in self.pool.unlisted(placement, holding):
            record = await self.registry.get_session(sid)
            if record is None:
                continue
            beat_at = self.beats[owner].at
            if not self.pool.lost_by_worker(seen(sid, owner, record), record.updated_at, beat_at):
                continue
            log.warning("session_lost_by_worker", session_id=sid, gpu_id=owner)
            if await self.executor.requeue(sid, record.epoch) is not None:
                await self.shell.step(
                    Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid, gpu_id=owner)
                )

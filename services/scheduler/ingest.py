"""The live scheduler's ears: what it hears on NATS and reads in Redis becomes the core's events.

Session events from the durable JetStream consumer (created -> ARRIVE, active, idle, closed ->
DEPART; a prompt is forwarded to the worker), worker heartbeats (a worker it did not know ->
GPU_READY; one that falls silent -> GPU_GONE; an operator's drain -> GPU_DRAIN or GPU_CORDON;
when the pass in flight ends -> the policy's ``note_pass``), provisioner events (ready, gone),
migration reports (to the migration waiting for each), and the registry, read every tick
(workers that joined or expired, operators' drains) and every few ticks to repair the core's
view (:meth:`Ingest.reconcile`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import FetchTimeoutError
from redis.exceptions import RedisError

from services.scheduler.core.types import Event, EventKind, GpuState
from shared.logging import get_logger
from shared.registry import WorkerRecord
from shared.states import SessionState
from shared.wire import (
    Heartbeat,
    MigrationReport,
    ProvisionerEvent,
    SessionEvent,
    SessionEventKind,
    WorkerStatus,
    decode_or_drop,
)

if TYPE_CHECKING:
    from services.scheduler.live import LiveScheduler

log = get_logger("turboserve.scheduler")

SESSION_EVENTS = {
    SessionEventKind.CREATED: EventKind.ARRIVE,
    SessionEventKind.ACTIVE: EventKind.ACTIVE,
    SessionEventKind.IDLE: EventKind.IDLE,
    SessionEventKind.CLOSED: EventKind.DEPART,
}
# Session events taken from the durable consumer at once (at most).
FETCH_BATCH = 32


class Ingest:
    """Turns what one leadership hears into the core's events (``live``: the scheduler)."""

    def __init__(self, live: LiveScheduler) -> None:
        self.live = live
        self.registry = live.ctx.registry
        self.ledger = live.ledger
        self.executor = live.executor
        self.rebuilt = False  # until then, heartbeats are only recorded (restore comes first)

    # -- NATS -----------------------------------------------------------------------------------
    async def on_beat(self, msg: Any) -> None:
        beat = decode_or_drop(msg.subject, msg.data, Heartbeat, log)
        if beat is None:
            return
        known = self.ledger.hear(beat, time.time())
        if not self.rebuilt:
            return
        wid = beat.worker_id
        core = self.live.core
        if known:
            if beat.pass_ends_at is not None:
                core.note_pass(wid, beat.pass_ends_at)
            steps = self.ledger.steps_to_resend(beat)
            if steps is not None:  # restarted, or a STEPS command was lost
                self.executor.send_steps(wid, steps)
            if (
                beat.status is WorkerStatus.DRAINING
                and wid not in self.ledger.our_drains
                and core.view.state_of(wid) is GpuState.READY
            ):
                mode = (await self.registry.operator_drains()).get(wid, "hold")
                await self._follow_operator_drain(wid, mode)
            return
        if beat.status is WorkerStatus.READY:
            await self.ready(wid, beat.gpu_kind)

    async def on_pool_event(self, msg: Any) -> None:
        event = decode_or_drop(msg.subject, msg.data, ProvisionerEvent, log)
        if event is None or not self.rebuilt:
            return  # a worker that came meanwhile is in the registry, which rebuild reads
        if event.status is WorkerStatus.READY and not self.ledger.knows(event.worker_id):
            await self.ready(event.worker_id, event.gpu_kind or self.live.default_kind)
        elif event.status is WorkerStatus.GONE:
            await self.gone(event.worker_id, reason=event.code or "gone")

    async def on_report(self, msg: Any) -> None:
        report = decode_or_drop(msg.subject, msg.data, MigrationReport, log)
        if report is not None:
            self.executor.migrations.on_report(report)

    async def consume(self) -> None:
        """Session events from the durable consumer, each acked once the core has it."""
        live = self.live
        while not live.stopping.is_set():
            psub = live.psub
            if psub is None:
                return
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
        live, sid = self.live, event.session_id
        if event.kind is SessionEventKind.PROMPT:
            live.spawn(self.executor.forward_prompt(sid, event.prompt), f"prompt-{sid}")
            return
        if event.kind is SessionEventKind.CLOSED:
            live.spawn(self.executor.stop_session(sid), f"stop-{sid}")
        elif event.kind in (SessionEventKind.CREATED, SessionEventKind.ACTIVE):
            why = await self._not_wanted(sid)
            if why is not None:
                log.info("session_event_outdated", session_id=sid, kind=str(event.kind), why=why)
                return
        await live.step(Event(time.time(), SESSION_EVENTS[event.kind], session_id=sid))

    async def _not_wanted(self, sid: str) -> str | None:
        """Why a session that an event says is (again) active is not, by the registry and the
        gateways as they are now (None: it is). An event waits in the durable stream until a
        scheduler takes it, so it may come from an earlier run: a session closed since, or
        one that nobody watches any more (its IDLE may have been lost with that run)."""
        record = await self.registry.get_session(sid)
        if record is None or record.state is SessionState.TERMINATED:
            return "closed"
        if await self.registry.unwatched([sid]):
            return "unwatched"
        return None

    # -- workers joining and leaving ------------------------------------------------------------
    async def ready(self, wid: str, kind: str) -> None:
        live = self.live
        if not self.ledger.join(wid, kind, time.time()):
            return
        live.refresh_profiles(force=True)
        await live.step(Event(time.time(), EventKind.GPU_READY, gpu_id=wid, gpu_kind=kind))
        if self.ledger.knows(wid) and live.core.view.state_of(wid) is None:
            # The core does not take it: one it gave back (or gave up on) while it booted,
            # which came up all the same. Stop it rather than pay for it unused.
            log.warning("gpu_ready_after_release", gpu_id=wid)
            self.ledger.release_unwanted(wid)
            self.executor.releases.start(wid)

    async def gone(self, wid: str, reason: str) -> None:
        if not self.ledger.leave(wid):
            return
        log.warning("gpu_gone", gpu_id=wid, reason=reason)
        registry = self.registry
        for sid, owner in (await registry.placement()).items():
            if owner == wid:
                record = await registry.get_session(sid)
                if record is not None and record.owner == wid:
                    await self.executor.requeue(record)
        await self.live.step(Event(time.time(), EventKind.GPU_GONE, gpu_id=wid))
        await registry.clear_operator_drain(wid)
        # Every view (ctl, /v1/cluster, the dashboard) shows it lost, then forgets it; a
        # worker that stopped cleanly removed its record already, and stays removed.
        await registry.mark_worker_lost(wid, self.live.settings.lost_worker_shown_s)

    # -- the registry, every tick ---------------------------------------------------------------
    async def scan_registry(self) -> None:
        """Workers as the registry sees them (a heartbeat missed on NATS is still in Redis): a
        ready one the core does not know joins, a known one whose record expired is gone."""
        records = {w.id: w for w in await self.registry.workers()}
        await self._follow_operator_drains(records)
        now = time.time()
        for wid in self.ledger.expired(records, now):
            await self.gone(wid, reason="expired")
        for wid in self.ledger.lost_records(records, now):
            log.warning("worker_record_lost", gpu_id=wid, status=str(records[wid].status))
            await self.registry.mark_worker_lost(wid, self.live.settings.lost_worker_shown_s)
        for wid, kind in self.ledger.joining(records):
            await self.ready(wid, kind)

    async def _follow_operator_drains(self, records: dict[str, WorkerRecord]) -> None:
        """An operator's drains as ``turboserve ctl`` records them: ``hold`` cordons the GPU
        (emptied, kept out of placement and of the autoscaler's count, never released), ``stop``
        drains it to be given back; a cordoned GPU whose worker is ready again and no longer
        held (``ctl undrain``) is uncordoned."""
        drains = await self.registry.operator_drains()
        view = self.live.core.view
        for wid in list(self.ledger.workers):
            record = records.get(wid)
            mode = self.ledger.drain_mode(wid, record, drains)
            if mode is not None:
                await self._follow_operator_drain(wid, mode)
            elif (
                wid in view.cordoned and record is not None and record.status is WorkerStatus.READY
            ):
                log.info("operator_undrain", gpu_id=wid)
                await self.live.step(Event(time.time(), EventKind.GPU_UNCORDON, gpu_id=wid))

    async def _follow_operator_drain(self, wid: str, mode: str) -> None:
        view = self.live.core.view
        state = view.state_of(wid)
        cordoned = wid in view.cordoned
        if mode == "stop" and (state is GpuState.READY or cordoned):
            log.info("operator_drain", gpu_id=wid, mode=mode)
            self.ledger.our_drains.add(wid)  # the core gives it back once empty
            await self.live.step(Event(time.time(), EventKind.GPU_DRAIN, gpu_id=wid))
        elif mode == "hold" and not cordoned and state in (GpuState.READY, GpuState.DRAINING):
            log.info("operator_drain", gpu_id=wid, mode=mode)
            self.ledger.our_drains.discard(wid)  # the operator's now, even if a scale-in began it
            await self.live.step(Event(time.time(), EventKind.GPU_CORDON, gpu_id=wid))

    # -- the registry, every few ticks ----------------------------------------------------------
    async def reconcile(self) -> None:
        """Repair the core's view where the registry says otherwise: sessions it never heard
        of (a lost event), and sessions placed elsewhere than it thinks."""
        live, registry, pool = self.live, self.registry, self.ledger
        view = live.core.view
        known = set(view.placement) | set(view.pending) | set(view.idle_sessions)
        pending = await registry.pending_sessions()
        for sid in pending:
            if sid not in known:
                await live.step(Event(time.time(), EventKind.ARRIVE, session_id=sid))
        await self.executor.replace_handed_back(pending)
        placement = await registry.placement()
        for sid, owner in placement.items():
            if sid in known or not pool.knows(owner):
                continue
            # A session the core never heard of runs on a worker (written back after Redis
            # restarted empty, say): the core learns it; placing it finds where it is.
            record = await registry.get_session(sid)
            if record is None or record.state not in (
                SessionState.EXECUTING,
                SessionState.SUSPENDED,
            ):
                continue
            await live.step(Event(time.time(), EventKind.ARRIVE, session_id=sid))
            if record.state is SessionState.SUSPENDED:
                await live.step(Event(time.time(), EventKind.IDLE, session_id=sid))
        for sid, gpu in view.placement.items():
            registered = placement.get(sid)
            if sid in self.executor.migrations.moving:
                # Not a failure: the core moved it when it decided, the registry follows at the
                # commit; the migration's own outcome corrects the core if it fails. Taking it
                # back now would have the core move it (or others) again, then back.
                continue
            if registered is not None and registered != gpu and pool.knows(registered):
                record = await registry.get_session(sid)
                if record is not None and record.state is SessionState.EXECUTING:
                    await live.step(
                        Event(
                            time.time(),
                            EventKind.MIGRATION_FAILED,
                            session_id=sid,
                            gpu_id=registered,
                        )
                    )
        await self._requeue_lost_by_workers(placement)

    async def _requeue_lost_by_workers(self, placement: dict[str, str]) -> None:
        """A worker that keeps saying it does not have a session it owns (an assignment it
        lost): the session goes back to pending and is placed again."""
        grace = self.live.settings.worker_timeout_s
        for sid, owner in placement.items():
            beat = self.ledger.beats.get(owner)
            if beat is None or not self.ledger.knows(owner) or sid in beat.sessions:
                continue
            record = await self.registry.get_session(sid)
            if (
                record is None
                or record.owner != owner
                or record.state is not SessionState.EXECUTING
                or beat.at - record.updated_at < grace
            ):
                continue
            log.warning("session_lost_by_worker", session_id=sid, gpu_id=owner)
            if await self.executor.requeue(record) is not None:
                await self.live.step(
                    Event(time.time(), EventKind.PLACEMENT_FAILED, session_id=sid, gpu_id=owner)
                )

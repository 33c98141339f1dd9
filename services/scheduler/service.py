"""The live scheduler: session events and the registry in, worker commands out.

This is the thin adapter of the design: it reads events from JetStream and the registry from
Redis, decides, and ships commands over NATS. For now it places each pending session on the
least-loaded ready worker; the policy core (``services.scheduler.core``) takes over the decisions
in the live-closed-loop wave, through the same adapter.

Robustness: the registry's pending set is the source of truth, so every tick re-examines it
(an event lost or a scheduler restart delays a placement by one tick, never loses it); sessions
of a worker whose heartbeat expired go back to pending and continue at their next seq elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import FetchTimeoutError

from shared.logging import get_logger
from shared.registry import RegistryError, SessionRecord, WorkerRecord
from shared.runner import ServiceContext
from shared.settings import SchedulerSettings
from shared.states import IllegalTransition, SessionState
from shared.streams import SCHEDULER_DURABLE, ensure_streams
from shared.wire import (
    Heartbeat,
    SessionEvent,
    SessionEventKind,
    WorkerCmdKind,
    WorkerCommand,
    WorkerStatus,
    decode_or_drop,
    encode,
)

log = get_logger("turboserve.scheduler")


def pick_worker(workers: list[WorkerRecord], placement: dict[str, str]) -> WorkerRecord | None:
    """The ready, alive worker with the lowest load (sessions / capacity) and a free slot."""
    load: dict[str, int] = {}
    for wid in placement.values():
        load[wid] = load.get(wid, 0) + 1
    best: tuple[float, str] | None = None
    chosen = None
    for w in workers:
        if not w.alive or w.status is not WorkerStatus.READY or w.capacity <= 0:
            continue
        used = load.get(w.id, 0)
        if used >= w.capacity:
            continue
        key = (used / w.capacity, w.id)
        if best is None or key < best:
            best, chosen = key, w
    return chosen


class SchedulerService:
    name = "scheduler"

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.ctx: ServiceContext | None = None
        self._lock = asyncio.Lock()  # one placement pass at a time
        self._stopping = asyncio.Event()
        self._warned_no_worker = False
        self._psub = None
        self._consumer: asyncio.Task[None] | None = None
        self._heartbeats: dict[str, Heartbeat] = {}  # latest per worker

    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        await ensure_streams(ctx.js, ctx.subjects)
        psub = await ctx.js.pull_subscribe(
            ctx.subjects.session_events, durable=SCHEDULER_DURABLE, stream=ctx.subjects.sessions_stream
        )
        self._psub = psub
        self._consumer = ctx.spawn(self._consume(psub), name="scheduler-events")
        await ctx.nc.subscribe(ctx.subjects.worker_heartbeat, cb=self._on_heartbeat)
        ctx.spawn(self._tick(), name="scheduler-tick")

    async def stop(self) -> None:
        self._stopping.set()
        # The consumer leaves within one fetch timeout; a pull subscription left open would
        # make the NATS drain wait for its full timeout.
        if self._consumer is not None:
            await asyncio.wait({self._consumer}, timeout=5.0)
        if self._psub is not None:
            psub, self._psub = self._psub, None
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        async with self._lock:  # let an in-flight placement pass finish
            pass

    # -- event intake ---------------------------------------------------------------------------
    async def _consume(self, psub) -> None:
        while not self._stopping.is_set():
            try:
                msgs = await psub.fetch(batch=32, timeout=1.0)
            except (TimeoutError, FetchTimeoutError, NatsTimeout):
                continue
            for msg in msgs:
                event = decode_or_drop(msg.subject, msg.data, SessionEvent, log)
                if event is None:
                    await msg.term()  # never redeliver garbage
                    continue
                try:
                    await self.handle_event(event)
                except RegistryError as exc:
                    log.warning("event_failed", session_id=event.session_id, kind=event.kind, error=str(exc))
                await msg.ack()

    async def _on_heartbeat(self, msg) -> None:
        beat = decode_or_drop(msg.subject, msg.data, Heartbeat, log)
        if beat is None:
            return
        self._heartbeats[beat.worker_id] = beat

    async def handle_event(self, event: SessionEvent) -> None:
        if event.kind is SessionEventKind.CREATED:
            await self.place_pending()
        elif event.kind is SessionEventKind.CLOSED:
            await self._stop_on_owner(event.session_id)
        else:
            log.debug("event_ignored", session_id=event.session_id, kind=str(event.kind))

    async def _stop_on_owner(self, session_id: str) -> None:
        ctx = self._ctx
        record = await ctx.registry.get_session(session_id)
        if record is None or record.owner is None:
            return
        cmd = WorkerCommand(
            kind=WorkerCmdKind.STOP, worker_id=record.owner, epoch=record.epoch, session_id=session_id
        )
        await ctx.nc.publish(ctx.subjects.worker_cmd(record.owner), encode(cmd))
        log.info("session_stop_sent", session_id=session_id, worker_id=record.owner)

    # -- periodic pass --------------------------------------------------------------------------
    async def _tick(self) -> None:
        while not self._stopping.is_set():
            live = await self.live_workers()
            await self.requeue_orphans(live)
            await self.place_pending()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=self.settings.tick_s)

    @property
    def _ctx(self) -> ServiceContext:
        assert self.ctx is not None, "service not started"
        return self.ctx

    async def live_workers(self) -> list[WorkerRecord]:
        """Workers whose heartbeat is fresh; forgets those silent for ``worker_timeout_s``."""
        ctx = self._ctx
        now = time.time()
        live = []
        for w in await ctx.registry.workers():
            if w.alive and now - w.updated_at < self.settings.worker_timeout_s:
                live.append(w)
            elif now - w.updated_at >= self.settings.worker_timeout_s:
                await ctx.registry.remove_worker(w.id)
                self._heartbeats.pop(w.id, None)
                log.warning("worker_forgotten", worker_id=w.id, silent_s=round(now - w.updated_at, 1))
        return live

    async def requeue_orphans(self, live: list[WorkerRecord]) -> None:
        """Sessions go back to pending when their worker is gone, or when its heartbeats keep
        saying it does not have them (a lost ASSIGN, a slot it could not take)."""
        ctx = self._ctx
        alive = {w.id for w in live}
        grace = self.settings.worker_timeout_s
        for session_id, owner in (await ctx.registry.placement()).items():
            beat = self._heartbeats.get(owner)
            if owner in alive and (beat is None or session_id in beat.sessions):
                continue
            record = await ctx.registry.get_session(session_id)
            if record is None or record.owner != owner:
                continue
            if owner in alive and beat is not None and beat.at - record.updated_at < grace:
                continue  # assigned recently: the worker may not have reached a chunk boundary
            try:
                await ctx.registry.transition(
                    session_id, SessionState.PENDING, expected_epoch=record.epoch, owner=None
                )
                log.warning("session_requeued", session_id=session_id, worker_id=owner,
                            reason="worker_alive_without_it" if owner in alive else "worker_gone")
            except (RegistryError, IllegalTransition) as exc:
                log.info("requeue_skipped", session_id=session_id, reason=str(exc))

    async def place_pending(self) -> None:
        ctx = self._ctx
        async with self._lock:
            pending = await ctx.registry.pending_sessions()
            if not pending:
                return
            workers = await self.live_workers()
            placement = await ctx.registry.placement()
            for session_id in pending:
                if self._stopping.is_set():
                    return
                record = await ctx.registry.get_session(session_id)
                if record is None or record.state is not SessionState.PENDING:
                    continue
                worker = pick_worker(workers, placement)
                if worker is None:
                    if not self._warned_no_worker:
                        log.warning("no_worker_available", pending=len(pending))
                        self._warned_no_worker = True
                    return
                self._warned_no_worker = False
                if await self._assign(record, worker):
                    placement[session_id] = worker.id

    async def _assign(self, record: SessionRecord, worker: WorkerRecord) -> bool:
        ctx = self._ctx
        try:
            claimed = await ctx.registry.claim(record.id, worker.id, expected_epoch=record.epoch)
        except (RegistryError, IllegalTransition) as exc:
            log.info("claim_lost", session_id=record.id, reason=str(exc))
            return False
        cmd = WorkerCommand(
            kind=WorkerCmdKind.ASSIGN,
            worker_id=worker.id,
            epoch=claimed.epoch,
            session_id=record.id,
            prompt=claimed.prompt,
            seed=claimed.seed,
            seq=claimed.last_seq + 1,
        )
        await ctx.nc.publish(ctx.subjects.worker_cmd(worker.id), encode(cmd))
        log.info("session_assigned", session_id=record.id, worker_id=worker.id, epoch=claimed.epoch,
                 seq=cmd.seq)
        return True

"""The worker service: commands in over NATS, chunks out, torch in its own thread.

Two halves that meet only through thread-safe hand-offs:

- the asyncio side (NATS, Redis): validates each command against the registry (fencing by
  epoch), queues it for the generation thread, publishes chunks, records progress, heartbeats;
- the generation thread: at each pass boundary applies the queued commands to the engine, runs
  one coalesced model pass for every active session (each at its own phase of its chunk, so a
  joining session waits one pass, not a chunk), encodes the frames of the chunks that pass
  completed, hands them over and waits until they are published (backpressure), then paces
  to the playback period.

Progress is recorded with a compare-and-set on (owner, epoch): a worker whose session was taken
away stops generating it at the next boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from shared.logging import get_logger
from shared.registry import RegistryError, WorkerRecord
from shared.runner import ServiceContext
from shared.settings import WorkerSettings
from shared.states import IllegalTransition, SessionState
from shared.streams import ensure_streams
from shared.wire import (
    Chunk,
    Heartbeat,
    WorkerCmdKind,
    WorkerCommand,
    WorkerStatus,
    decode_or_drop,
    encode,
)

log = get_logger("turboserve.worker")

FPS = 16.0  # playback rate of the frames a chunk carries


@dataclass
class _Owned:
    """What the worker knows of a session it generates."""

    epoch: int
    seq_base: int  # wire seq = seq_base + engine seq
    next_due: float = field(default_factory=time.time)


class ChunkTimes:
    """Measured chunk time per batch size (exponential moving average), for heartbeats."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._ms: dict[int, float] = {}
        self._lock = threading.Lock()

    def add(self, batch: int, ms: float) -> None:
        with self._lock:
            old = self._ms.get(batch)
            self._ms[batch] = ms if old is None else old + self.alpha * (ms - old)

    def snapshot(self) -> dict[int, float]:
        with self._lock:
            return {b: round(v, 3) for b, v in sorted(self._ms.items())}


class WorkerService:
    name = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.engine: Any = None
        self.ctx: ServiceContext | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.status = WorkerStatus.BOOTING
        self.owned: dict[str, _Owned] = {}  # touched only by the generation thread
        self.commands: queue.Queue[WorkerCommand] = queue.Queue()
        self.chunk_times = ChunkTimes()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._thread_done: asyncio.Future[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, ctx: ServiceContext) -> None:
        from services.gpu_worker.engine import Engine, EngineConfig

        self.ctx, self.loop = ctx, asyncio.get_running_loop()
        await ensure_streams(ctx.js, ctx.subjects)
        await self._heartbeat_once()  # visible as booting while the model loads
        config = EngineConfig(
            preset=self.settings.preset,
            device=self.settings.device,
            max_sessions=self.settings.max_sessions,
            seed=self.settings.seed,
            checkpoint=self.settings.checkpoint,
        )
        self.engine = await asyncio.to_thread(Engine, config)
        log.info("engine_ready", device=self.engine.device, capacity=self.engine.capacity,
                 preset=self.settings.preset)
        await ctx.nc.subscribe(ctx.subjects.worker_cmd(self.worker_id), cb=self._on_command)
        await ctx.nc.flush()  # the subscription is live on the server before we say READY
        self._thread_done = self.loop.create_future()
        self._thread = threading.Thread(target=self._generate_forever, name="generation", daemon=True)
        self._thread.start()
        ctx.spawn(self._watch_thread(), name="worker-generation")
        self.status = WorkerStatus.READY
        await self._heartbeat_once()
        self._heartbeat_task = ctx.spawn(self._heartbeats(), name="worker-heartbeat")

    async def stop(self) -> None:
        """Take no new sessions, stop the generation thread, hand sessions back, leave."""
        if self.ctx is None:
            return
        self.status = WorkerStatus.DRAINING
        with contextlib.suppress(Exception):
            await self.ctx.registry.set_worker_status(self.worker_id, WorkerStatus.DRAINING)
        self._halt.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        await self._release_sessions()
        if self._heartbeat_task is not None:  # else a late beat would re-register us
            self._heartbeat_task.cancel()
            await asyncio.wait({self._heartbeat_task}, timeout=5.0)
        with contextlib.suppress(Exception):
            await self.ctx.registry.remove_worker(self.worker_id)

    async def _release_sessions(self) -> None:
        """Put the sessions this worker still owns back to pending, to continue elsewhere."""
        for session_id, owned in list(self.owned.items()):
            await self._release(session_id, owned.epoch)
            log.info("session_released", session_id=session_id)
        self.owned.clear()

    async def _watch_thread(self) -> None:
        assert self._thread_done is not None
        await self._thread_done
        if self._thread_error is not None:
            raise RuntimeError("generation thread failed") from self._thread_error

    # -- commands (asyncio side) ----------------------------------------------------------------
    async def _on_command(self, msg: Any) -> None:
        cmd = decode_or_drop(msg.subject, msg.data, WorkerCommand, log)
        if cmd is None:
            return
        if cmd.worker_id != self.worker_id or cmd.session_id is None:
            log.warning("command_misaddressed", kind=str(cmd.kind), to=cmd.worker_id)
            return
        if cmd.kind is not WorkerCmdKind.STOP and not await self._epoch_current(cmd):
            return
        self.commands.put(cmd)

    async def _epoch_current(self, cmd: WorkerCommand) -> bool:
        """Fencing: act only on a command whose epoch and owner match the registry."""
        assert self.ctx is not None and cmd.session_id is not None
        record = await self.ctx.registry.get_session(cmd.session_id)
        if record is None or record.owner != self.worker_id or record.epoch != cmd.epoch:
            log.warning("command_fenced", session_id=cmd.session_id, kind=str(cmd.kind), epoch=cmd.epoch,
                        registry_epoch=None if record is None else record.epoch)
            return False
        return True

    # -- generation thread ----------------------------------------------------------------------
    def _generate_forever(self) -> None:
        try:
            while not self._halt.is_set():
                self._apply_commands(block=not self.engine.active_sessions())
                active = self.engine.active_sessions()
                if not active:
                    continue
                self._pace(active)
                if self._halt.is_set():
                    break
                self._step_and_publish()
        except BaseException as exc:  # noqa: BLE001 - reported to the service via the future
            self._thread_error = exc
        finally:
            assert self.loop is not None and self._thread_done is not None
            with contextlib.suppress(RuntimeError):  # loop already closed
                self.loop.call_soon_threadsafe(_set_done, self._thread_done)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=0.1) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: WorkerCommand) -> None:
        """Apply one command at a chunk boundary. A command the engine refuses is logged and
        dropped: it never takes the generation thread (and every other session) down."""
        from services.gpu_worker.engine import EngineError, EngineFull

        sid = cmd.session_id
        assert sid is not None
        eng = self.engine
        try:
            if cmd.kind is WorkerCmdKind.ASSIGN:
                if eng.has_session(sid):
                    eng.remove_session(sid)
                eng.add_session(sid, cmd.prompt or "", cmd.seed or 0)
                self.owned[sid] = _Owned(epoch=cmd.epoch, seq_base=cmd.seq)
            elif cmd.kind is WorkerCmdKind.STOP:
                self._drop(sid, reason="stopped")
            elif not eng.has_session(sid):
                log.warning("command_for_unknown_session", session_id=sid, kind=str(cmd.kind))
                return
            elif cmd.kind is WorkerCmdKind.SUSPEND:
                eng.suspend(sid, wait=True)  # mid-chunk: right after its chunk is done
            elif cmd.kind is WorkerCmdKind.RESUME:
                eng.resume(sid)
                self.owned[sid].next_due = time.time()
            elif cmd.kind is WorkerCmdKind.PROMPT:
                eng.set_prompt(sid, cmd.prompt or "")
            log.info("command_applied", session_id=sid, kind=str(cmd.kind), epoch=cmd.epoch)
        except EngineFull:
            # No slot: hand the session straight back so the scheduler places it elsewhere.
            log.warning("engine_full", session_id=sid, capacity=eng.capacity)
            self._run_on_loop(self._release(sid, cmd.epoch))
        except EngineError as exc:
            log.warning("command_refused", session_id=sid, kind=str(cmd.kind), error=str(exc))

    def _run_on_loop(self, coro: Any) -> Any:
        """Run a coroutine on the event loop from the generation thread and wait for it."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _release(self, session_id: str, epoch: int) -> None:
        assert self.ctx is not None
        try:
            await self.ctx.registry.transition(
                session_id, SessionState.PENDING, expected_epoch=epoch, owner=None
            )
        except (RegistryError, IllegalTransition) as exc:
            log.info("release_skipped", session_id=session_id, reason=str(exc))

    def _drop(self, session_id: str, reason: str) -> None:
        if self.engine.has_session(session_id):
            self.engine.remove_session(session_id)
        if self.owned.pop(session_id, None) is not None:
            log.info("session_dropped", session_id=session_id, reason=reason)

    def _pace(self, active: list[str]) -> None:
        """Wait until the earliest active session's next chunk is due (playback pace).

        Only at a boundary of every active session: a session in the middle of its chunk keeps
        the batch's passes running (pausing would stall every session in the batch)."""
        if self.settings.chunk_period_s <= 0:
            return
        if any(self.engine.passes_to_boundary(s) for s in active):
            return
        due = min(self.owned[s].next_due for s in active if s in self.owned) if self.owned else time.time()
        delay = due - time.time()
        if delay > 0:
            self._halt.wait(delay)

    def _step_and_publish(self) -> None:
        from services.gpu_worker.codec import encode_frames

        # One batched pass; each session is at its own phase of its chunk, so a session that
        # joins waits for one pass, not a whole chunk. Most passes complete no chunk.
        results = self.engine.pass_step()
        if not results:
            return
        done_at = time.time()
        chunks = []
        for r in results:
            self.chunk_times.add(r.batch, r.gen_ms)
            owned = self.owned.get(r.session_id)
            if owned is None:
                continue
            frames = r.frames
            chunks.append(Chunk(
                session_id=r.session_id,
                seq=owned.seq_base + r.seq,
                worker_id=self.worker_id,
                epoch=owned.epoch,
                encoding="jpeg",
                frames=encode_frames(frames, fmt="jpeg", quality=self.settings.jpeg_quality),
                width=int(frames.shape[2]),
                height=int(frames.shape[1]),
                fps=FPS,
                gen_ms=r.gen_ms,
                batch=r.batch,
                due_at=owned.next_due,
                done_at=done_at,
            ))
            # The next chunk is due when this one has played out, or now if we are late.
            period = self.settings.chunk_period_s
            owned.next_due = max(owned.next_due + period, done_at) if period > 0 else done_at
        for session_id in self._run_on_loop(self._publish(chunks)):
            self._drop(session_id, reason="fenced")

    # -- publishing (asyncio side) --------------------------------------------------------------
    async def _publish(self, chunks: list[Chunk]) -> list[str]:
        """Publish chunks, then record progress; returns the sessions we no longer own."""
        ctx = self.ctx
        assert ctx is not None
        fenced = []
        for chunk in chunks:
            still_owner = await ctx.registry.record_progress(
                chunk.session_id, self.worker_id, chunk.epoch, chunk.seq
            )
            if not still_owner:
                fenced.append(chunk.session_id)
                continue
            await ctx.nc.publish(ctx.subjects.chunks(chunk.session_id), encode(chunk))
        return fenced

    # -- heartbeats -----------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await self._heartbeat_once()

    async def _heartbeat_once(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        telemetry = self._telemetry()
        sessions = sorted(list(self.owned))  # a copy: the generation thread mutates it
        capacity = self.engine.capacity if self.engine is not None else self.settings.max_sessions
        record = WorkerRecord(
            id=self.worker_id,
            status=self.status,
            capacity=capacity,
            device=telemetry.get("device", self.settings.device),
            gpu_kind=self.settings.gpu_kind,
            active=len(sessions),
            chunk_ms=self.chunk_times.snapshot(),
            mem_free_bytes=telemetry.get("mem_free_bytes"),
        )
        await ctx.registry.heartbeat(record, ttl_s=3 * self.settings.heartbeat_s)
        beat = Heartbeat(
            worker_id=self.worker_id,
            status=self.status,
            capacity=capacity,
            active=len(sessions),
            sessions=sessions,
            device=record.device,
            chunk_ms=record.chunk_ms,
            mem_free_bytes=record.mem_free_bytes,
            mem_total_bytes=telemetry.get("mem_total_bytes"),
        )
        await ctx.nc.publish(ctx.subjects.worker_heartbeat, encode(beat))

    def _telemetry(self) -> dict[str, Any]:
        if self.engine is None:
            return {}
        try:
            return dict(self.engine.telemetry())
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop heartbeats
            log.debug("telemetry_failed", error=str(exc))
            return {}


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)

"""The worker service: commands in over NATS, chunks out, torch in its own thread.

Three parts that meet only through thread-safe hand-offs, none waiting on another:

- the command intake (event loop): decodes each command, checks it against the registry
  (fencing by epoch), answers it when it came as a request, and puts it in the inbox;
- the generation loop (:mod:`generation`, its own thread, the engine's only user): applies what
  the inbox holds at pass boundaries, paces every session to playback, runs the batched passes,
  puts chunks and notices in the outbox and publishes an immutable status after every pass;
- the publisher (event loop, :class:`Publisher`): publishes what the outbox holds, in order, and
  records each chunk's progress with a compare-and-set on (owner, epoch) on a task of its own,
  so a slow or paused Redis never holds chunks back; a worker whose session was taken away
  hears it there and drops it at the next boundary. Heartbeats report the loop's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import Header
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError
from redis.exceptions import RedisError

from services.gpu_worker import telemetry
from services.gpu_worker.encoder import ChunkEncoder, chunk_duration_s, default_threads
from services.gpu_worker.engine import (
    Engine,
    EngineConfig,
    MemoryBudgetExceeded,
    StepFloorAboveFull,
)
from services.gpu_worker.engine.prompts import PromptEncoder
from services.gpu_worker.engine_host import EngineHost
from services.gpu_worker.fencing import CommandFence
from services.gpu_worker.fmp4 import FragmentTooLarge
from services.gpu_worker.generation import GenerationLoop, SessionFacts
from services.gpu_worker.handoff.endpoint import HandoffEndpoint
from services.gpu_worker.inbox import CommandInbox, Control
from services.gpu_worker.input_feed import InputFeed
from services.gpu_worker.metrics import WorkerMetrics
from services.gpu_worker.outbox import Flushed, Forget, HandBack, Outbox, OutChunk, Outgoing
from services.gpu_worker.recovery import from_fields, to_fields
from shared.logging import get_logger
from shared.ops import OpsServer, close_ops, start_ops
from shared.profile import LatencyProfile
from shared.registry import RegistryError, WorkerRecord
from shared.runner import ServiceContext, subscriptions_live
from shared.settings import (
    DEFAULT_CHUNK_PERIOD_S,
    SettingsError,
    WorkerSettings,
    parse_resolution,
)
from shared.states import IllegalTransition, SessionState
from shared.streams import ensure_streams
from shared.supervisor import Supervisor
from shared.video import ChunkRetention, PayloadTooSmall, check_payload
from shared.wire import (
    WORKER_WIDE_COMMANDS,
    Chunk,
    CommandReply,
    Heartbeat,
    NoticeKind,
    ProvisionerEvent,
    SessionNotice,
    WorkerCmdKind,
    WorkerCommand,
    WorkerStatus,
    decode_or_drop,
    encode,
)

log = get_logger("turboserve.worker")


@dataclass(frozen=True, slots=True)
class Pace:
    """What the worker runs at, resolved from its settings and, when it emulates a GPU kind,
    from that kind's latency profile."""

    slots: int
    period_s: float
    lead_s: float
    kind: str  # the GPU kind it reports (the emulated one, when emulating)
    emulated: LatencyProfile | None = None

    @classmethod
    def of(cls, settings: WorkerSettings) -> Pace:
        profile = emulated_profile(settings)
        if profile is None:
            period = (
                DEFAULT_CHUNK_PERIOD_S
                if settings.chunk_period_s is None
                else settings.chunk_period_s
            )
            slots, kind = settings.slots, settings.gpu_kind
        else:
            period = (
                profile.deadline_ms / 1000.0
                if settings.chunk_period_s is None
                else settings.chunk_period_s
            )
            slots = profile.capacity if settings.max_sessions is None else settings.max_sessions
            kind = profile.gpu_kind
        lead = period if settings.pace_lead_s is None else settings.pace_lead_s
        return cls(slots=slots, period_s=period, lead_s=lead, kind=kind, emulated=profile)

    def pass_floor_ms(self, batch: int) -> float:
        assert self.emulated is not None
        return self.emulated.pass_ms(batch)


def emulated_profile(settings: WorkerSettings) -> LatencyProfile | None:
    """The profile of the GPU kind the worker emulates (``TURBOSERVE_EMULATE``), or None.
    Raises SettingsError when the profile cannot be read or describes another kind."""
    if not settings.emulate:
        return None
    from shared.profile import DEFAULT_PROFILE, ProfileError, load_profile

    try:
        profile = load_profile(settings.emulate_profile or DEFAULT_PROFILE)
    except (ProfileError, OSError) as exc:
        raise SettingsError([f"TURBOSERVE_EMULATE_PROFILE: {exc}"]) from None
    if profile.gpu_kind.lower() != settings.emulate.lower():
        raise SettingsError(
            [
                f"TURBOSERVE_EMULATE={settings.emulate!r}: the profile "
                f"{profile.name!r} describes {profile.gpu_kind}"
            ]
        )
    return profile


# Chunks kept per session to publish again after NATS comes back (a restarted NATS lost the
# in-memory chunk stream, and what was published while it was down).
RECENT_CHUNKS = 16


# A chunk or notice goes to the chunk stream with JetStream's acknowledgement while NATS is
# connected: one the stream cannot take now (a cluster electing the stream's new leader) is
# sent again, each try waiting PUBLISH_ACK_S, for up to PUBLISH_RETRY_S before it counts as
# unpublished. While NATS is away (or once it came back during the tries) the client buffers
# it instead, and the republish after the reconnection sends it again once the streams are
# declared. Each carries an id (``Nats-Msg-Id``): the stream keeps one copy of a message sent
# twice (a try that timed out after the stream took it, a republish).
PUBLISH_ACK_S = 2.0
PUBLISH_RETRY_S = 15.0
_NOT_NOW = (NoStreamResponseError, ServiceUnavailableError, NatsTimeoutError)
MSG_ID = Header.MSG_ID.value


def message_id(session_id: str, epoch: int, seq: int) -> str:
    """A chunk's: what tells the stream two sends of one chunk apart from two chunks."""
    return f"{session_id}/{epoch}/{seq}"


# How long a notice waits for the registry to say the session is still ours before it goes
# out anyway (a notice informs; fencing is the progress record's job): a stalled Redis must
# not hold back the chunks behind it.
NOTICE_CHECK_S = 0.5


class Publisher:
    """The event loop's side of the outbox: publishes, in order, what the generation thread
    made, and records each chunk's progress on a task of its own.

    A chunk is published, then its progress (and recovery point) recorded: a worker lost in
    between leaves the chunk published and the log behind, so the session's next owner makes
    that chunk again (same seq, which viewers already have) rather than skipping it. Only the
    latest unrecorded chunk of a session is recorded (a record says "up to this seq"), so a
    Redis that stalls delays the records, never the chunks. The record is fenced by (owner,
    epoch): a worker whose session moved on learns it there, publishes nothing more of that
    session at that epoch, and tells the generation thread to drop it.

    Nothing is dropped in silence: a chunk that cannot go out (its encode failed its bound,
    the stream did not take it within PUBLISH_RETRY_S, NATS refused it) is counted
    (``on_unpublished``) and told to the session's viewers by an ``unpublished`` notice, and
    the session goes on at the next seq. A notice that cannot go out either is kept, and sent
    before anything else once NATS takes messages again. (While NATS is away the client holds
    what is published, and the republish after the reconnection sends it again.)"""

    def __init__(
        self,
        ctx: ServiceContext,
        worker_id: str,
        outbox: Outbox,
        fence: Callable[[str, int], None],
        on_unpublished: Callable[[], None] = lambda: None,
    ) -> None:
        self.ctx = ctx
        self.worker_id = worker_id
        self.outbox = outbox
        self.fence = fence  # thread-safe: the generation thread drops the session
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()  # the outbox has something
        # session -> its last chunks, encoded, with their message ids
        self._recent: dict[str, deque[tuple[str, bytes]]] = {}
        self._publishing = asyncio.Lock()  # a republish goes out before any newer chunk
        self._unrecorded: dict[str, OutChunk] = {}  # session -> its latest unrecorded chunk
        self._to_record = asyncio.Event()
        self._fenced: dict[str, int] = {}  # session -> the epoch the registry refused
        self._hand_backs = Supervisor("hand_back_failed", log=log)
        self._owed: deque[SessionNotice] = deque()  # notices NATS did not take, in order
        self.on_unpublished = on_unpublished
        self.unpublished = 0
        outbox.on_put = self._wake

    def _wake(self) -> None:
        """Called by the generation thread: never blocks on the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to publish to
            self._loop.call_soon_threadsafe(self._ready.set)

    async def publish_forever(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self.publish_queued()

    async def record_forever(self) -> None:
        while True:
            await self._to_record.wait()
            self._to_record.clear()
            await self.record_queued()

    async def publish_queued(self) -> None:
        async with self._publishing:
            await self._send_owed()
            for item in self.outbox.take():
                await self._publish(item)

    async def record_queued(self) -> None:
        pending, self._unrecorded = self._unrecorded, {}
        for item in pending.values():
            await self._record(item)

    async def finish_hand_backs(self) -> None:
        """Wait for the hand-backs under way (at shutdown: none is left half done)."""
        await self._hand_backs.wait()

    async def republish(self) -> None:
        """After a NATS reconnection: publish each session's recent chunks again, before any
        newer one, so that viewers (who skip what they have by seq) miss none."""
        async with self._publishing:
            count = 0
            for sid, chunks in list(self._recent.items()):
                for msg_id, data in list(chunks):
                    await self.ctx.nc.publish(
                        self.ctx.subjects.chunks(sid), data, headers={MSG_ID: msg_id}
                    )
                    count += 1
            await self._send_owed()
        log.info("chunks_republished", chunks=count, sessions=len(self._recent))

    def _is_fenced(self, session_id: str, epoch: int) -> bool:
        refused = self._fenced.get(session_id)
        return refused is not None and epoch <= refused

    async def _publish(self, item: Outgoing) -> None:
        if isinstance(item, OutChunk):
            head = item.head
            sid = head.session_id
            if item.encoded is not None:
                with contextlib.suppress(Exception):  # an encode that failed: below
                    await asyncio.wrap_future(item.encoded)
            if self._is_fenced(sid, head.epoch):
                return
            try:
                chunk = item.chunk
            except FragmentTooLarge as exc:
                await self._unpublished(head, f"not encoded within its bound: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - one chunk's encode, never the service
                await self._unpublished(head, f"not encoded: {exc!r}")
                return
            if item.encoded is not None and (hold := item.encoded.result().fragment.hold) > 1:
                # Sent, with fewer pictures: only so busy a picture at so low a bitrate fits.
                log.warning("chunk_held_to_fit", session_id=sid, seq=chunk.seq, hold=hold)
            data = encode(chunk)
            msg_id = message_id(sid, chunk.epoch, chunk.seq)
            # Kept first: a chunk NATS would not take now goes out again after reconnection.
            self._recent.setdefault(sid, deque(maxlen=RECENT_CHUNKS)).append((msg_id, data))
            refused = await self._refused(sid, data, msg_id, seq=chunk.seq, wire_bytes=len(data))
            if refused is None:
                self._unrecorded[sid] = item
                self._to_record.set()
            else:
                self._recent[sid].pop()  # told as unpublished: not sent again after all
                await self._unpublished(head, f"NATS refused it: {refused!r}")
        elif isinstance(item, SessionNotice):
            if self._is_fenced(item.session_id, item.epoch) or not await self._owns(item):
                return
            await self._send(item, notice=str(item.kind))
        elif isinstance(item, HandBack):
            self._hand_backs.spawn(
                self.hand_back(item.session_id, item.epoch), f"hand-back-{item.session_id}"
            )
        elif isinstance(item, Flushed):
            if not item.done.done():
                item.done.set_result(None)
        else:
            assert isinstance(item, Forget)
            self._recent.pop(item.session_id, None)
            self._fenced.pop(item.session_id, None)
            self._unrecorded.pop(item.session_id, None)

    async def _send(self, item: SessionNotice, **what: object) -> bool:
        """Publish a notice on its session's chunk subject; False (logged) when the stream
        does not take it: the publisher goes on with the next item."""
        # Its own id (two prompt notices may name the same next chunk), kept across its tries.
        msg_id = f"{item.session_id}/notice/{uuid.uuid4().hex}"
        return await self._refused(item.session_id, encode(item), msg_id, **what) is None

    async def _refused(
        self, session_id: str, data: bytes, msg_id: str, **what: object
    ) -> NatsError | None:
        """Publish on the session's chunk subject (see PUBLISH_RETRY_S); what NATS refused it
        with (logged), or None when the stream took it or the client holds it for the
        reconnection."""
        nc = self.ctx.nc
        subject, headers = self.ctx.subjects.chunks(session_id), {MSG_ID: msg_id}
        reconnects = nc.stats["reconnects"]
        give_up = time.monotonic() + PUBLISH_RETRY_S
        pause = 0.05
        while True:
            try:
                if not nc.is_connected or nc.stats["reconnects"] != reconnects:
                    await nc.publish(subject, data, headers=headers)
                else:
                    await self.ctx.js.publish(subject, data, timeout=PUBLISH_ACK_S, headers=headers)
                return None
            except _NOT_NOW as exc:
                if time.monotonic() + pause > give_up:
                    log.warning("not_published", session_id=session_id, error=repr(exc), **what)
                    return exc
                await asyncio.sleep(pause)
                pause = min(1.0, pause * 2)
            except NatsError as exc:
                log.warning("not_published", session_id=session_id, error=repr(exc), **what)
                return exc

    async def _unpublished(self, chunk: Chunk, reason: str) -> None:
        """A chunk that did not go out: counted, and its viewers told (now, or once NATS takes
        the notice); the session goes on at the next seq."""
        self.unpublished += 1
        self.on_unpublished()
        log.warning("chunk_unpublished", session_id=chunk.session_id, seq=chunk.seq, reason=reason)
        self._owed.append(
            SessionNotice(
                session_id=chunk.session_id,
                kind=NoticeKind.UNPUBLISHED,
                worker_id=self.worker_id,
                epoch=chunk.epoch,
                next_seq=chunk.seq + 1,
                detail=f"chunk {chunk.seq} was not published ({reason})",
            )
        )
        await self._send_owed()

    async def _send_owed(self) -> None:
        """The notices NATS did not take, oldest first, until one is refused again. Kept while
        the connection is down: what the client buffers then goes out at the reconnection,
        before the streams (lost with a restarted server's memory) are declared again, and
        would reach no viewer; the reconnection's hook sends them after."""
        while self._owed and self.ctx.nc.is_connected:
            notice = self._owed[0]
            if self._is_fenced(notice.session_id, notice.epoch):
                self._owed.popleft()
                continue
            if not await self._send(notice, notice=str(notice.kind)):
                return
            self._owed.popleft()

    async def _record(self, item: OutChunk) -> None:
        chunk = item.head  # its facts; the fragment is published already and not needed here
        sid = chunk.session_id
        if self._is_fenced(sid, chunk.epoch):
            return
        point = item.recovery
        fields = to_fields(point, chunk.seq + 1) if point is not None else None
        try:
            owner = await self.ctx.registry.record_progress(
                sid, self.worker_id, chunk.epoch, chunk.seq, fields
            )
        except RedisError as exc:
            # Redis away (restarting): keep generating; the next chunk's record catches up,
            # and the heartbeat puts back what a restart lost.
            log.warning("progress_not_recorded", session_id=sid, seq=chunk.seq, error=str(exc))
            return
        if not owner:
            self._fenced[sid] = max(chunk.epoch, self._fenced.get(sid, chunk.epoch))
            self.fence(sid, chunk.epoch)

    async def _owns(self, notice: SessionNotice) -> bool:
        try:
            record = await asyncio.wait_for(
                self.ctx.registry.get_session(notice.session_id), NOTICE_CHECK_S
            )
        except (RedisError, TimeoutError):
            return True  # cannot check now: a notice is informative, never a fencing decision
        return (
            record is not None
            and record.owner == self.worker_id
            and record.epoch == notice.epoch
            and record.state is not SessionState.TERMINATED
        )

    async def hand_back(self, session_id: str, epoch: int) -> None:
        """Put a session back to pending (to be placed elsewhere), if still ours at ``epoch``."""
        try:
            await self.ctx.registry.transition(
                session_id, SessionState.PENDING, expected_epoch=epoch, owner=None
            )
        except (RegistryError, IllegalTransition, RedisError) as exc:
            log.info("release_skipped", session_id=session_id, reason=str(exc))


class WorkerService:
    name = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.pace = Pace.of(settings)
        self.worker_id = settings.worker_id
        # What the event loop keeps of the engine, which only the generation thread touches:
        # its fixed facts, and the prompt encoder (thread-safe: encoding starts on arrival).
        self.capacity = self.pace.slots
        self.state_bytes = 0
        # The quality budget's bounds: the model's full count of denoising steps and the floor
        # (0 until the model is loaded).
        self.full_steps = 0
        self.min_steps = 0
        self.device: torch.device | None = None
        self.prompts: PromptEncoder | None = None
        self.ctx: ServiceContext | None = None
        self.status = WorkerStatus.BOOTING
        self.inbox = CommandInbox()
        self.generation: GenerationLoop | None = None
        self.publisher: Publisher | None = None
        self.encoder: ChunkEncoder | None = None
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._thread_done: asyncio.Future[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.handoff: HandoffEndpoint | None = None
        self.metrics = WorkerMetrics()
        self.ops: OpsServer | None = None
        self.fence: CommandFence | None = None
        self.inputs: InputFeed | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, ctx: ServiceContext) -> None:
        loop = asyncio.get_running_loop()
        self.ctx = ctx
        self.fence = CommandFence(ctx.registry, self.worker_id)
        await ensure_streams(
            ctx.js, ctx.subjects, ChunkRetention.of(ctx.settings), ctx.settings.stream_replicas
        )
        self.ops = await start_ops(
            ctx,
            self.metrics.registry,
            service="worker",
            details=lambda: {"status": str(self.status)},
        )
        await self._heartbeat_once()  # visible as booting while the model loads
        config = EngineConfig(
            preset=self.settings.preset,
            device=self.settings.device,
            # Unset and not emulating: as many as the memory budget gives.
            max_sessions=(
                None
                if self.settings.max_sessions is None and self.pace.emulated is None
                else self.pace.slots
            ),
            max_decodes_per_pass=self.settings.max_decodes_per_pass,
            seed=self.settings.seed,
            checkpoint=self.settings.checkpoint,
            model=self.settings.model,
            resolution=(
                parse_resolution(self.settings.resolution) if self.settings.resolution else None
            ),
            text_device=self.settings.text_device,
            prompt_recache=self.settings.prompt_recache,
            min_steps=self.settings.min_steps,
        )
        try:
            engine = await asyncio.to_thread(Engine, config)
        except MemoryBudgetExceeded as exc:
            raise SettingsError([f"TURBOSERVE_MAX_SESSIONS: {exc}"]) from None
        except StepFloorAboveFull as exc:
            raise SettingsError(
                [
                    f"TURBOSERVE_MIN_STEPS={exc.min_steps}: the model {exc.model!r} runs "
                    f"{exc.full_steps} denoising steps per chunk; the floor must be "
                    f"1..{exc.full_steps}"
                ]
            ) from None
        log.info(
            "engine_ready",
            device=engine.device,
            capacity=engine.capacity,
            model=engine.model_config.name,
            state_bytes=engine.state_bytes,
            prompt_recache=engine.prompt_recache,
            full_steps=engine.full_steps,
            min_steps=engine.min_steps,
            **engine.sources,
        )
        # A chunk must fit one message of this server: refused now, not chunk after chunk.
        frames = engine.model_config.video_frames_per_chunk
        try:
            wire_bytes = check_payload(
                self.settings.video_bitrate,
                chunk_duration_s(frames, self.pace.period_s),
                ctx.nc.max_payload,
            )
        except PayloadTooSmall as exc:
            raise SettingsError([str(exc)]) from None
        log.info(
            "chunk_bound",
            video_bitrate=self.settings.video_bitrate,
            chunk_wire_bytes=wire_bytes,
            max_payload=ctx.nc.max_payload,
            resolution=f"{engine.model_config.height}x{engine.model_config.width}",
        )
        self.encoder = ChunkEncoder(
            self.settings.encode_threads or default_threads(engine.capacity),
            bitrate=self.settings.video_bitrate,
            period_s=self.pace.period_s,
        )
        self.capacity, self.state_bytes = engine.capacity, engine.state_bytes
        self.full_steps, self.min_steps = engine.full_steps, engine.min_steps
        self.device, self.prompts = torch.device(engine.device), engine.prompts
        self.generation = GenerationLoop(
            engine,
            self.inbox,
            worker_id=self.worker_id,
            period_s=self.pace.period_s,
            lead_s=self.pace.lead_s,
            encoder=self.encoder,
            pass_floor_ms=self.pace.pass_floor_ms if self.pace.emulated else None,
            on_chunk=self.metrics.lateness.observe,
            recovery_log=self.settings.recovery_log,
        )
        self.publisher = Publisher(
            ctx,
            self.worker_id,
            self.generation.outbox,
            self.generation.fence,
            on_unpublished=self.metrics.chunks_unpublished.inc,
        )
        ctx.reconnect_hooks.append(self.publisher.republish)  # after the streams are declared again
        ctx.spawn(self.publisher.publish_forever(), name="worker-publish")
        ctx.spawn(self.publisher.record_forever(), name="worker-progress")
        if self.pace.emulated is not None:
            log.info(
                "emulating",
                gpu_kind=self.pace.kind,
                profile=self.pace.emulated.name,
                slots=self.pace.slots,
                chunk_period_s=self.pace.period_s,
            )
        host = EngineHost(
            self.worker_id,
            self.generation,
            self.inbox,
            is_draining=lambda: self.status is not WorkerStatus.READY,
            device=engine.device,
            capacity=engine.capacity,
            layout=engine.layout,
            registry=ctx.registry,
            reservations=engine.reservations,
        )
        # The input buffers are the engine's thread-safe part (with its video sessions' list).
        self.inputs = InputFeed(
            ctx.nc,
            ctx.subjects,
            engine.video_sessions,
            engine.input_buffer,
            (engine.model_config.height, engine.model_config.width),
            self.generation.input_arrived,
            lambda outcome: self.metrics.input_frames.labels(outcome).inc(),
        )
        ctx.spawn(self.inputs.run_forever(), name="worker-input")
        del engine  # from here on the generation thread's alone
        self.handoff = HandoffEndpoint(ctx.nc, ctx.registry, ctx.subjects, host, self.settings)
        await self.handoff.start()
        await ctx.nc.subscribe(ctx.subjects.worker_cmd(self.worker_id), cb=self._on_command)
        await ctx.nc.subscribe(ctx.subjects.provisioner_events, cb=self._on_pool_event)
        await subscriptions_live(ctx.nc)  # live on the server before we say READY
        self._thread_done = loop.create_future()
        self._thread = threading.Thread(target=self._generate, name="generation", daemon=True)
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
        if self.handoff is not None:  # handoffs in flight finish or abort first
            await self.handoff.close()
        self.inbox.close()
        if self.inputs is not None:
            await self.inputs.close()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        if self.encoder is not None:  # the chunks handed to the encoders are encoded
            await asyncio.to_thread(self.encoder.close)
        if self.publisher is not None:  # what the generation thread made last goes out
            await self.publisher.publish_queued()
            await self.publisher.record_queued()
            await self.publisher.finish_hand_backs()
        await self._hand_back_sessions()
        if self._heartbeat_task is not None:  # else a late beat would re-register us
            self._heartbeat_task.cancel()
            await asyncio.wait({self._heartbeat_task}, timeout=5.0)
        with contextlib.suppress(Exception):
            await self.ctx.registry.remove_worker(self.worker_id)
        await close_ops(self.ops)

    def _generate(self) -> None:
        assert self.generation is not None
        try:
            self.generation.run()
        except BaseException as exc:  # noqa: BLE001 - reported to the service via the future
            self._thread_error = exc
        finally:
            done = self._thread_done
            assert done is not None
            with contextlib.suppress(RuntimeError):  # loop already closed
                done.get_loop().call_soon_threadsafe(_set_done, done)

    async def _watch_thread(self) -> None:
        assert self._thread_done is not None
        await self._thread_done
        if self._thread_error is not None:
            raise RuntimeError("generation thread failed") from self._thread_error

    async def _hand_back_sessions(self) -> None:
        """Put the sessions this worker still owns back to pending, to continue elsewhere."""
        if self.generation is None or self.publisher is None:
            return
        for session_id, facts in self.generation.status().facts.items():
            await self.publisher.hand_back(session_id, facts.epoch)
            log.info("session_released", session_id=session_id)

    # -- commands (event loop) ------------------------------------------------------------------
    async def _on_command(self, msg: Any) -> None:
        cmd = decode_or_drop(msg.subject, msg.data, WorkerCommand, log)
        if cmd is None:
            return
        answer = await self._accept(cmd)
        if isinstance(answer, CommandReply):
            await _respond(msg, answer)
            return
        # Answered once applied (STEPS), on a task of its own: the commands behind it do not
        # wait for the generation loop's next pass boundary.
        assert self.ctx is not None
        self.ctx.spawn(_respond_when_done(msg, answer), name="worker-command-answer")

    async def _accept(self, cmd: WorkerCommand) -> CommandReply | asyncio.Future[CommandReply]:
        """Validate a command and queue it for the generation loop; the answer to send, or
        its future when the answer waits for the generation loop."""

        def refuse(code: str, detail: str) -> CommandReply:
            log.warning(
                "command_refused",
                kind=str(cmd.kind),
                session_id=cmd.session_id,
                code=code,
                detail=detail,
            )
            return CommandReply(
                worker_id=self.worker_id,
                ok=False,
                command_id=cmd.command_id,
                code=code,
                detail=detail,
            )

        ok = CommandReply(worker_id=self.worker_id, ok=True, command_id=cmd.command_id)
        if cmd.worker_id != self.worker_id:
            return refuse("misaddressed", f"command for {cmd.worker_id}")
        assert self.fence is not None
        # The term, and a session's epoch, as the registry has them now; a STOP's epoch is
        # checked against what this worker holds (below).
        faults = await self.fence.faults(
            cmd,
            session=cmd.session_id is not None
            and cmd.kind not in WORKER_WIDE_COMMANDS
            and cmd.kind not in (WorkerCmdKind.STEPS, WorkerCmdKind.STOP),
        )
        if faults.leader:
            return refuse("stale_leader", faults.leader)
        if cmd.kind is WorkerCmdKind.STEPS:
            if cmd.steps is None:
                return refuse("invalid", "STEPS needs steps (denoising steps per chunk)")
            return self._set_steps(cmd, cmd.steps)
        if cmd.kind in WORKER_WIDE_COMMANDS:
            self._set_draining(cmd.kind is WorkerCmdKind.DRAIN)
            await self._heartbeat_once()
            return ok
        if cmd.session_id is None:
            return refuse("invalid", f"{cmd.kind} needs a session_id")
        if cmd.kind is WorkerCmdKind.ASSIGN and self.status is WorkerStatus.DRAINING:
            await self._hand_back_assignment(cmd)
            return refuse("draining", "this worker takes no new sessions")
        if cmd.kind is not WorkerCmdKind.STOP:
            if faults.epoch:
                return refuse("stale_epoch", faults.epoch)
        else:
            # A STOP comes after the registry moved on (closing bumps the epoch), so it is not
            # checked against the registry; one older than what this worker holds is stale.
            held = self.generation.status().facts.get(cmd.session_id) if self.generation else None
            if held is not None and cmd.epoch < held.epoch:
                return refuse(
                    "stale_epoch", f"held at epoch {held.epoch}, command epoch {cmd.epoch}"
                )
        if (
            cmd.kind is WorkerCmdKind.ASSIGN
            and cmd.seq > 0
            and self.settings.recovery_log
            and self.generation is not None
        ):
            await self._find_recovery(cmd)
        if cmd.prompt and cmd.kind in (WorkerCmdKind.ASSIGN, WorkerCmdKind.PROMPT) and self.prompts:
            # Start encoding now, off the generation pass; the engine takes the embedding at a
            # chunk boundary once it is there.
            self.prompts.request(cmd.prompt)
        if cmd.kind is WorkerCmdKind.MIGRATE:
            if self.handoff is None or not cmd.target or cmd.target == self.worker_id:
                return refuse("invalid", "MIGRATE needs another worker as its target")
            assert self.ctx is not None
            self.ctx.spawn(self._migrate(cmd), name=f"migrate-{cmd.session_id}")
            return ok  # started; the outcome is a MigrationReport
        self.inbox.put(cmd)
        return ok

    def _set_steps(self, cmd: WorkerCommand, steps: int) -> asyncio.Future[CommandReply]:
        """Queue the step budget for the generation thread, which applies it at its next pass
        boundary to the chunks that start from then on. The answer (the count applied) comes
        once the loop's status, which heartbeats report, shows it: a beat taken after the
        answer never shows the budget before it. A control that fails (never expected) goes
        unanswered, and the scheduler's heartbeat check sends the budget again."""
        assert self.generation is not None
        generation, loop = self.generation, asyncio.get_running_loop()
        answer: asyncio.Future[CommandReply] = loop.create_future()

        def resolve(applied: int) -> None:
            reply = CommandReply(
                worker_id=self.worker_id,
                ok=True,
                command_id=cmd.command_id,
                detail=f"steps={applied}",
            )
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to answer
                loop.call_soon_threadsafe(_settle, answer, reply, None)

        def reject(exc: BaseException) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, answer, None, exc)

        self.inbox.put(Control("steps", lambda: generation.set_steps(steps), resolve, reject))
        return answer

    async def _migrate(self, cmd: WorkerCommand) -> None:
        assert self.handoff is not None
        try:
            report = await self.handoff.migrate(cmd)
        except Exception as exc:  # noqa: BLE001 - one failed handoff never takes the worker down
            log.error("migration_failed", session_id=cmd.session_id, error=repr(exc))
            return
        self.metrics.handoffs.labels("ok" if report.ok else report.code or "failed").inc()
        log.info(
            "migration_done",
            session_id=cmd.session_id,
            dst=cmd.target,
            ok=report.ok,
            code=report.code,
            transfer_ms=round(report.transfer_ms, 2),
        )

    async def _find_recovery(self, cmd: WorkerCommand) -> None:
        """A session given to us at ``seq`` > 0 whose previous owner was lost: its log, if it
        was written for exactly that seq, lets the generation loop rebuild it."""
        assert self.ctx is not None and self.generation is not None and cmd.session_id
        fields = await self.ctx.registry.recovery_log(cmd.session_id)
        found = from_fields(cmd.session_id, fields) if fields else None
        if found is None:
            log.info("no_recovery_log", session_id=cmd.session_id, seq=cmd.seq)
            return
        point, next_seq = found
        if next_seq != cmd.seq:
            log.warning(
                "recovery_log_out_of_step", session_id=cmd.session_id, seq=cmd.seq, log_seq=next_seq
            )
            return
        self.generation.offer_recovery(cmd.session_id, cmd.epoch, point)

    async def _on_pool_event(self, msg: Any) -> None:
        """A worker the provisioner reports gone: tear down our links with it."""
        event = decode_or_drop(msg.subject, msg.data, ProvisionerEvent, log)
        if event is None or event.status is not WorkerStatus.GONE or self.handoff is None:
            return
        if event.worker_id != self.worker_id:
            with contextlib.suppress(Exception):
                await self.handoff.forget_peer(event.worker_id)

    async def _hand_back_assignment(self, cmd: WorkerCommand) -> None:
        assert self.publisher is not None and cmd.session_id is not None
        await self.publisher.hand_back(cmd.session_id, cmd.epoch)

    def _set_draining(self, draining: bool) -> None:
        if self.status is WorkerStatus.BOOTING:
            return
        self.status = WorkerStatus.DRAINING if draining else WorkerStatus.READY
        log.info("worker_status", status=str(self.status))

    # -- heartbeats -----------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self._heartbeat_once()
            except RedisError as exc:  # Redis away: keep beating; it comes back
                log.warning("heartbeat_not_recorded", error=str(exc))

    async def _heartbeat_once(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        device = self._telemetry()
        loop_status = self.generation.status() if self.generation is not None else None
        capacity = loop_status.capacity if loop_status and loop_status.capacity else self.capacity
        chunk_ms = dict(loop_status.chunk_ms) if loop_status else {}
        pass_ms = dict(loop_status.pass_ms) if loop_status else {}
        sessions = loop_status.sessions if loop_status else ()
        active = loop_status.active if loop_status else ()
        suspended = loop_status.suspended if loop_status else ()
        cost = self.handoff.cost() if self.handoff is not None else None
        handoff_addr = ""
        if self.handoff is not None and not self.handoff.closing:
            handoff_addr = self.handoff.address
        record = WorkerRecord(
            id=self.worker_id,
            status=self.status,
            capacity=capacity,
            device=device.get("device", self.settings.device),
            gpu_kind=self.pace.kind,
            active=len(active),
            chunk_ms=chunk_ms,
            mem_free_bytes=device.get("mem_free_bytes"),
            sessions=sessions,
            suspended=suspended,
            waiting=loop_status.waiting if loop_status else 0,
            pass_ms=pass_ms,
            keeping_pace=loop_status.keeping_pace if loop_status else True,
            emulated=self.pace.kind if self.pace.emulated else "",
            handoff_addr=handoff_addr,
            steps=loop_status.steps if loop_status else 0,
            full_steps=self.full_steps,
            chunks_unpublished=self.publisher.unpublished if self.publisher else 0,
        )
        self._observe(record)
        beat = Heartbeat(
            worker_id=self.worker_id,
            status=self.status,
            capacity=capacity,
            active=len(active),
            sessions=list(sessions),
            device=record.device,
            chunk_ms=chunk_ms,
            mem_free_bytes=record.mem_free_bytes,
            mem_total_bytes=device.get("mem_total_bytes"),
            suspended=list(suspended),
            waiting=record.waiting,
            pass_ms=pass_ms,
            lead_ms=dict(loop_status.lead_ms) if loop_status else {},
            keeping_pace=record.keeping_pace,
            emulated=self.pace.kind if self.pace.emulated else None,
            gpu_kind=self.pace.kind,
            chunk_period_s=self.pace.period_s,
            state_bytes=self.state_bytes,
            handoff_addr=handoff_addr,
            handoff_fixed_ms=cost.fixed_ms if cost else None,
            handoff_ms_per_mib=cost.ms_per_mib if cost else None,
            prompt_switch_ms=loop_status.prompt_switch_ms if loop_status else None,
            pass_ends_at=loop_status.pass_ends_at if loop_status else None,
            steps=record.steps,
            full_steps=self.full_steps,
            min_steps=self.min_steps,
            chunks_unpublished=record.chunks_unpublished,
        )
        # NATS first: the scheduler hears a worker whose Redis writes fail (Redis restarting).
        await ctx.nc.publish(ctx.subjects.worker_heartbeat(beat.worker_id), encode(beat))
        await ctx.registry.heartbeat(record, ttl_s=3 * self.settings.heartbeat_s)
        if loop_status is not None and loop_status.facts:
            await self._reannounce(loop_status.facts)

    async def _reannounce(self, facts: Mapping[str, SessionFacts]) -> None:
        """Sessions this worker generates that the registry lost (Redis restarted empty):
        their records go back as this worker knows them, and they keep streaming."""
        assert self.ctx is not None
        registry = self.ctx.registry
        for sid in await registry.missing_sessions(sorted(facts)):
            f = facts[sid]
            state = SessionState.SUSPENDED if f.suspended else SessionState.EXECUTING
            if await registry.reannounce_session(
                sid,
                owner=self.worker_id,
                epoch=f.epoch,
                state=state,
                prompt=f.prompt,
                seed=f.seed,
                last_seq=f.last_seq,
                token_hash=f.token_hash,
                owner_key=f.owner_key,
                input=f.input,
                strength=f.strength,
            ):
                log.warning(
                    "session_reannounced", session_id=sid, epoch=f.epoch, last_seq=f.last_seq
                )

    def _observe(self, record: WorkerRecord) -> None:
        m = self.metrics
        for batch, ms in record.chunk_ms.items():
            m.chunk_ms.labels(str(batch)).set(ms)
        for batch, ms in record.pass_ms.items():
            m.pass_ms.labels(str(batch)).set(ms)
        m.sessions.labels("executing").set(record.active)
        m.sessions.labels("suspended").set(len(record.suspended))
        m.sessions.labels("waiting").set(record.waiting)
        m.keeping_pace.set(1 if record.keeping_pace else 0)
        m.steps.set(record.steps)

    def _telemetry(self) -> dict[str, Any]:
        """The device's report (mode, memory): read here, not from the engine."""
        if self.device is None:
            return {}
        try:
            return telemetry.device_report(self.device)
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop heartbeats
            log.debug("telemetry_failed", error=str(exc))
            return {}


async def _respond(msg: Any, reply: CommandReply) -> None:
    """Answer a command sent as a request (a plain publish has no reply subject)."""
    if msg.reply:
        with contextlib.suppress(Exception):
            await msg.respond(encode(reply))


async def _respond_when_done(msg: Any, answer: asyncio.Future[CommandReply]) -> None:
    try:
        reply = await answer
    except Exception as exc:  # noqa: BLE001 - a command not applied is left unanswered
        log.error("command_not_applied", error=repr(exc))
        return
    await _respond(msg, reply)


def _settle(
    future: asyncio.Future[CommandReply], reply: CommandReply | None, exc: BaseException | None
) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        assert reply is not None
        future.set_result(reply)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)

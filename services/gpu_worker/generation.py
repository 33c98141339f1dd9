"""The generation loop: the worker's one thread, which owns the engine.

At every pass boundary it takes what the inbox holds (commands from the scheduler, controls from
the event loop), applies it, decides which sessions take the next batched pass (pacing: a
session ahead of playback sits out, see :mod:`pacing`), runs the pass, hands the chunks the
pass completed to the encoder pool (:mod:`encoder`) and puts them in the outbox, in order, while
they encode; the event loop drains the outbox and publishes each chunk once it is encoded. When
nobody is due it waits on the inbox with a timeout to the next due pass, so a new command is
heard at once.

It never waits on the event loop: a put in the outbox returns at once, and while the outbox
holds its bound of chunks (the event loop is behind) it holds back new passes, still applying
commands, until a take wakes it. What the event loop learns later comes back through the inbox:
a session fenced (its progress record says another owner) is dropped at the next boundary.

Only this thread touches the engine and the sessions' bookkeeping; the event loop reads
:meth:`GenerationLoop.status`, an immutable snapshot published after every pass and every
command, and changes things only through the inbox (handoffs: :meth:`freeze`, :meth:`unfreeze`,
:meth:`adopt` and :meth:`drop` run as controls).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from services.gpu_worker.encoder import ChunkEncoder, EncodedChunk, default_threads, playback_fps
from services.gpu_worker.engine import (
    ChunkResult,
    Engine,
    EngineError,
    EngineFull,
    PassOutOfMemory,
    RecoveryPoint,
)
from services.gpu_worker.handoff.codes import HandoffCode
from services.gpu_worker.handoff.host import FrozenSession, HostRefused
from services.gpu_worker.inbox import CommandInbox, Control, InboxItem
from services.gpu_worker.outbox import Forget, HandBack, Outbox, OutChunk
from services.gpu_worker.pacing import ChunkEstimate, PlaybackClock, plan_pass
from shared.logging import get_logger
from shared.settings import DEFAULT_VIDEO_BITRATE
from shared.wire import (
    Chunk,
    NoticeKind,
    SessionInput,
    SessionNotice,
    WorkerCmdKind,
    WorkerCommand,
)

log = get_logger("turboserve.worker")


@dataclass(frozen=True, slots=True)
class TimedEncode:
    """A chunk being encoded whose whole time (passes and encode) goes into the chunk times."""

    encoded: Future[EncodedChunk]
    batch: int
    gen_ms: float


@dataclass(slots=True)
class OwnedSession:
    """What the worker knows of a session it generates."""

    epoch: int
    seq_base: int  # wire seq = seq_base + engine seq
    clock: PlaybackClock
    frozen: bool = False  # handed off (migration in progress): sits out of every pass
    suspend_pending: bool = False  # SUSPEND arrived mid-chunk: suspend at the boundary
    # A RESUME that found every slot taken (by sessions about to leave: a suspend waiting for
    # its chunk boundary, a migration out): when it arrived; resumed at the first boundary with
    # a free slot, its clock from then.
    resume_waiting: float | None = None
    chunk_ms: float = 0.0  # wall time of the current chunk's passes so far
    chunk_batch: int = 0  # batch of those passes; -1 once it changed
    token_hash: str = ""  # for writing its record back if Redis loses it
    owner_key: str = ""
    # A prompt change still being encoded (umT5, off the pass): announced once it applies, so
    # the ack names the chunk it really starts at.
    prompt_unannounced: str | None = None
    # A video session at a chunk boundary whose input chunk was not there when its chunk was
    # due to start: since when. Its clock slips by the wait (the input's lateness, not the
    # worker's) once the input is there.
    input_wait_since: float | None = None


@dataclass(frozen=True, slots=True)
class SessionFacts:
    """What the worker knows of a session it owns: enough to write its record back."""

    epoch: int
    last_seq: int  # wire seq of its last chunk (-1: none yet)
    prompt: str
    seed: int
    suspended: bool
    token_hash: str = ""
    owner_key: str = ""
    input: SessionInput = SessionInput.TEXT
    strength: float | None = None


def _frozen_map(values: Mapping[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(dict(values))


def _empty_map() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class LoopStatus:
    """The loop as the event loop may see it (heartbeats, /metrics, handoff admission): built
    by the generation thread after every pass and command, never changed after (read-only
    mappings), so any thread may read it without a lock."""

    sessions: tuple[str, ...] = ()
    active: tuple[str, ...] = ()
    suspended: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    waiting: int = 0
    lead_ms: Mapping[str, float] = field(default_factory=_empty_map)
    keeping_pace: bool = True
    facts: Mapping[str, SessionFacts] = field(default_factory=_empty_map)
    chunk_ms: Mapping[int, float] = field(default_factory=_empty_map)  # per batch size
    pass_ms: Mapping[int, float] = field(default_factory=_empty_map)  # per batch size
    prompt_switch_ms: float | None = None  # median time a prompt switch added to its pass
    # When the pass in flight ends (wall clock: its start plus the measured time of a pass at
    # its batch; None before the first timed one): heartbeats carry it to the scheduler, whose
    # placement counts a joining session's wait for the next pass boundary.
    pass_ends_at: float | None = None
    steps: int = 0  # the step budget in force (the quality budget)
    capacity: int = 0  # sessions the engine takes now (lowered after a pass out of memory)


class PassTimes:
    """Measured wall time of one pass per batch size (moving average), for pacing and for
    heartbeats. Under emulation this is the emulated time (the pass is paced to it). Kept by
    the generation thread; the status carries a copy."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._ms: dict[int, float] = {}

    def add(self, batch: int, ms: float) -> None:
        old = self._ms.get(batch)
        self._ms[batch] = ms if old is None else old + self.alpha * (ms - old)

    def snapshot(self) -> dict[int, float]:
        return {b: round(v, 3) for b, v in sorted(self._ms.items())}


class GenerationLoop:
    def __init__(
        self,
        engine: Engine,
        inbox: CommandInbox,
        *,
        worker_id: str,
        period_s: float,
        lead_s: float,
        encoder: ChunkEncoder | None = None,
        pass_floor_ms: Callable[[int], float] | None = None,
        clock: Callable[[], float] = time.time,
        on_chunk: Callable[[float], None] | None = None,
        recovery_log: bool = False,
        outbox_chunks: int | None = None,
    ) -> None:
        self.engine = engine
        self.inbox = inbox
        # Chunks for the event loop; at ``outbox_chunks`` waiting (default: two per slot) no
        # new pass runs until it drains.
        self.outbox = Outbox(outbox_chunks or 2 * engine.capacity)
        self.outbox.on_take = self._wake
        self.worker_id = worker_id
        self.period_s = period_s
        self.lead_s = lead_s
        # The H.264 encoders (default: one thread per slot, at the default bitrate).
        self.encoder = encoder or ChunkEncoder(
            default_threads(engine.capacity), bitrate=DEFAULT_VIDEO_BITRATE, period_s=period_s
        )
        self._timed_encodes: list[TimedEncode] = []
        # Emulation: the least wall time of a pass at a batch size (a GPU kind's profile).
        self.pass_floor_ms = pass_floor_ms
        self.now = clock
        inbox.clock = clock  # arrival times on the loop's own clock
        self.on_chunk = on_chunk  # called with each chunk's lateness (s), for metrics
        self.recovery_log = recovery_log  # log a recovery point with every chunk
        self._offered: dict[tuple[str, int], RecoveryPoint] = {}  # from the event loop
        self._offered_lock = threading.Lock()
        self.owned: dict[str, OwnedSession] = {}
        self.pass_times = PassTimes()
        self.chunk_times = PassTimes()  # whole chunks, by the batch of their last pass
        self._boundary_controls: list[tuple[str, Control[Any]]] = []
        # The budget in force from the start: a heartbeat before the first pass shows it too.
        self._status = LoopStatus(steps=engine.steps)
        self._waiting = 0
        self._slow_passes = 0  # consecutive emulated passes the real compute could not meet
        self.keeping_pace = True
        self._pass_ends_at: float | None = None  # see LoopStatus.pass_ends_at

    # -- the thread -----------------------------------------------------------------------------
    def run(self) -> None:
        wait: float | None = 0.0
        while not self.inbox.closed:
            for item, arrived in self.inbox.take_timed(wait):
                self._apply(item, arrived)
            self._time_encodes()
            self._settle_boundaries()
            now = self.now()
            plan = plan_pass(now, self._candidates(), self.lead_s, self._estimate())
            self._waiting = len(plan.waiting)
            if plan.participants and not self.inbox.closed and self.outbox.has_room():
                self._run_pass(plan.participants)
                wait = 0.0
            elif plan.participants:
                wait = None  # the outbox is full: until a take (or a command) wakes us
            else:
                wait = plan.wait_s(now)
            self._publish_status()

    def _wake(self) -> None:
        self.inbox.wake()

    def fence(self, session_id: str, epoch: int) -> None:
        """The registry says this worker no longer owns the session at ``epoch`` (thread-safe;
        from the event loop): it is dropped at the next pass boundary, unless it was given to
        this worker again meanwhile (a later epoch) or is frozen for a handoff. A frozen
        session's record is refused because the handoff moved its epoch on (records go out
        after the chunks, so the last one can land after the freeze): the handoff's outcome
        decides its fate, :meth:`drop` on a commit, :meth:`unfreeze` on an abort."""

        def run() -> None:
            owned = self.owned.get(session_id)
            if owned is None or owned.epoch > epoch:
                return
            if owned.frozen:
                log.info("fence_left_to_the_handoff", session_id=session_id, epoch=epoch)
                return
            self.drop(session_id, reason="fenced")

        self.inbox.put(Control("fence", run, _ignore, _ignore))

    def offer_recovery(self, session_id: str, epoch: int, point: RecoveryPoint) -> None:
        """The event loop found a recovery log for an assignment at ``epoch`` (thread-safe):
        the session is rebuilt from it instead of starting over."""
        with self._offered_lock:
            self._offered[(session_id, epoch)] = point

    def _take_offer(self, session_id: str, epoch: int) -> RecoveryPoint | None:
        with self._offered_lock:
            point = self._offered.pop((session_id, epoch), None)
            for key in [k for k in self._offered if k[0] == session_id and k[1] < epoch]:
                del self._offered[key]
            return point

    def status(self) -> LoopStatus:
        return self._status

    # -- commands and controls ------------------------------------------------------------------
    def _apply(self, item: InboxItem, arrived: float | None = None) -> None:
        """Apply one inbox item; ``arrived``: when it reached the worker (default: now)."""
        if isinstance(item, Control):
            if item.session_id is not None:
                self._boundary_controls.append((item.session_id, item))
            else:
                _run_control(item, self._publish_status)
            return
        try:
            self._apply_command(item, self.now() if arrived is None else min(arrived, self.now()))
        except EngineError as exc:  # refused by the engine: logged, never fatal
            log.warning(
                "command_refused", session_id=item.session_id, kind=str(item.kind), error=str(exc)
            )

    def _apply_command(self, cmd: WorkerCommand, arrived: float) -> None:
        sid = cmd.session_id
        if sid is None:
            return
        owned = self.owned.get(sid)
        if cmd.kind is WorkerCmdKind.STOP:
            self.drop(sid, reason="stopped")
            return
        if owned is not None and cmd.epoch < owned.epoch:
            log.info(
                "command_stale",
                session_id=sid,
                kind=str(cmd.kind),
                epoch=cmd.epoch,
                current=owned.epoch,
            )
            return
        if cmd.kind is WorkerCmdKind.ASSIGN:
            self._assign(cmd, owned, arrived)
            return
        if owned is None or not self.engine.has_session(sid):
            log.warning("command_for_unknown_session", session_id=sid, kind=str(cmd.kind))
            return
        if owned.frozen:
            log.warning("command_for_frozen_session", session_id=sid, kind=str(cmd.kind))
            return
        owned.epoch = cmd.epoch
        if cmd.kind is WorkerCmdKind.SUSPEND:
            self._suspend(sid, owned)
        elif cmd.kind is WorkerCmdKind.RESUME:
            self._resume(sid, owned, arrived)
        elif cmd.kind is WorkerCmdKind.PROMPT:
            self.engine.set_prompt(sid, cmd.prompt or "", strength=cmd.strength)
            if self.engine.prompts.ready(cmd.prompt or "") is None:
                owned.prompt_unannounced = cmd.prompt or ""  # announced when it applies
                log.info(
                    "command_applied",
                    session_id=sid,
                    kind=str(cmd.kind),
                    epoch=cmd.epoch,
                    encoding=True,
                )
                return
            owned.prompt_unannounced = None
            mid_chunk = self.engine.phases().get(sid, 0) > 0
            next_seq = owned.seq_base + self.engine.next_seq(sid) + (1 if mid_chunk else 0)
            self._notify(sid, owned, NoticeKind.PROMPT, next_seq)
        log.info("command_applied", session_id=sid, kind=str(cmd.kind), epoch=cmd.epoch)

    def _assign(self, cmd: WorkerCommand, owned: OwnedSession | None, arrived: float) -> None:
        sid = cmd.session_id
        assert sid is not None
        engine = self.engine
        if owned is not None and cmd.epoch == owned.epoch:
            return  # the same assignment again: already applied
        if (
            owned is not None
            and engine.has_session(sid)
            and not owned.frozen
            and owned.seq_base + engine.next_seq(sid) == cmd.seq
        ):
            # Re-placed on the worker that still holds its state, at the seq it is at: keep
            # the state (the video continues), take the new epoch.
            owned.epoch = cmd.epoch
            owned.token_hash = cmd.token_hash or owned.token_hash
            owned.owner_key = cmd.owner_key or owned.owner_key
            if sid in engine.suspended_sessions():
                self._resume(sid, owned, arrived)  # announced (resumed, at the new epoch)
            else:  # viewers hear of the new epoch before its next chunk
                self._notify(
                    sid,
                    owned,
                    NoticeKind.PLACED,
                    cmd.seq,
                    detail=f"placed again on {self.worker_id}, which holds its state",
                )
            log.info("session_reassigned_in_place", session_id=sid, epoch=cmd.epoch, seq=cmd.seq)
            return
        if owned is not None:
            self.drop(sid, reason="reassigned")
        point = self._take_offer(sid, cmd.epoch) if cmd.seq > 0 else None
        try:
            if point is not None:
                engine.restore(point, input=cmd.input, strength=cmd.strength)
            else:
                engine.add_session(
                    sid, cmd.prompt or "", cmd.seed or 0, input=cmd.input, strength=cmd.strength
                )
        except EngineFull:
            log.warning("engine_full", session_id=sid, capacity=engine.capacity)
            self.outbox.put(HandBack(sid, cmd.epoch))
            return
        except PassOutOfMemory as exc:  # its rebuild ran out of memory: another worker's turn
            log.warning("restore_out_of_memory", session_id=sid, error=str(exc))
            self.outbox.put(HandBack(sid, cmd.epoch))
            return
        except EngineError as exc:  # a log it cannot use: start over (and say so)
            log.warning("recovery_failed", session_id=sid, error=str(exc))
            point = None
            engine.add_session(
                sid, cmd.prompt or "", cmd.seed or 0, input=cmd.input, strength=cmd.strength
            )
        base = cmd.seq - point.seq if point is not None else cmd.seq
        # Playback starts when the assignment reached the worker: the wait for this pass
        # boundary is part of the first chunk's lateness.
        owned = OwnedSession(
            epoch=cmd.epoch,
            seq_base=base,
            clock=PlaybackClock(arrived),
            token_hash=cmd.token_hash,
            owner_key=cmd.owner_key,
        )
        self.owned[sid] = owned
        if cmd.seq == 0:
            self._notify(sid, owned, NoticeKind.PLACED, cmd.seq)
        elif point is not None:
            self._notify(
                sid,
                owned,
                NoticeKind.RECOVERED,
                cmd.seq,
                detail=f"its worker was lost; rebuilt on {self.worker_id}",
            )
        else:
            # This worker has no state for it (its previous worker is gone, and no log): the
            # video starts over from the prompt, and the viewer is told so.
            self._notify(
                sid,
                owned,
                NoticeKind.RESTARTED,
                cmd.seq,
                detail="session state lost; restarted from the prompt",
            )
        log.info(
            "session_assigned",
            session_id=sid,
            epoch=cmd.epoch,
            seq=cmd.seq,
            recovered=point is not None,
        )

    def _suspend(self, sid: str, owned: OwnedSession) -> None:
        owned.resume_waiting = None  # paused again before it could resume
        if sid in self.engine.suspended_sessions():
            return
        if self.engine.passes_to_boundary(sid):
            owned.suspend_pending = True  # right after the chunk in progress
            return
        self.engine.suspend(sid)
        self._notify(sid, owned, NoticeKind.SUSPENDED, owned.seq_base + self.engine.next_seq(sid))

    def _resume(self, sid: str, owned: OwnedSession, arrived: float) -> None:
        if owned.suspend_pending:
            owned.suspend_pending = False  # never left the device
            return
        if sid not in self.engine.suspended_sessions():
            return
        try:
            self.engine.resume(sid)
        except EngineFull:
            # The scheduler counts a session as gone when it decides to suspend or move it;
            # here it holds its slot until its chunk boundary or handoff. Not an error: the
            # resume waits for the first boundary with a free slot (_settle_boundaries).
            if owned.resume_waiting is None:
                owned.resume_waiting = arrived
                log.info("resume_deferred", session_id=sid, capacity=self.engine.capacity)
            return
        owned.resume_waiting = None
        owned.clock = PlaybackClock(arrived)  # a new start of playback, from the request
        self._notify(sid, owned, NoticeKind.RESUMED, owned.seq_base + self.engine.next_seq(sid))

    def drop(self, session_id: str, reason: str) -> None:
        """Forget a session (stop, fenced, handed off); its pending controls fail."""
        if self.engine.has_session(session_id):
            self.engine.remove_session(session_id)
        if self.owned.pop(session_id, None) is not None:
            log.info("session_dropped", session_id=session_id, reason=reason)
        self.inbox.forget(session_id)
        self.outbox.put(Forget(session_id))
        keep = []
        for sid, control in self._boundary_controls:
            if sid == session_id:
                control.reject(LookupError(f"session {session_id} left this worker ({reason})"))
            else:
                keep.append((sid, control))
        self._boundary_controls = keep

    def set_steps(self, steps: int) -> int:
        """The step budget (a STEPS command; run as a control, on this thread) for the chunks
        that start from the next pass on; chunks in progress keep theirs. Returns the count
        applied: ``steps`` within the engine's floor and the model's full count."""
        applied = self.engine.set_step_budget(steps)
        log.info("command_applied", kind=str(WorkerCmdKind.STEPS), steps=applied, asked=steps)
        return applied

    # -- handoffs (run as controls, on this thread) -------------------------------------------
    def freeze(self, session_id: str, epoch: int, *, on_device: bool = False) -> FrozenSession:
        """At the session's chunk boundary: its state, exported (with ``on_device``, a clone on
        the engine's device); it sits out of every pass until :meth:`unfreeze` or
        :meth:`drop`, so the copy never changes under a transfer."""
        owned = self.owned.get(session_id)
        if owned is None or not self.engine.has_session(session_id):
            raise HostRefused(HandoffCode.UNKNOWN_SESSION, f"{session_id} is not on this worker")
        if owned.epoch != epoch:
            raise HostRefused(
                HandoffCode.STALE_EPOCH, f"{session_id} is here at epoch {owned.epoch}, not {epoch}"
            )
        if owned.frozen:
            raise HostRefused(HandoffCode.BUSY, f"{session_id} is already being handed off")
        snapshot = self.engine.export_state(session_id, on_device=on_device)
        owned.frozen = True
        owned.suspend_pending = False
        suspended = session_id in self.engine.suspended_sessions()
        return FrozenSession(
            snapshot=snapshot,
            next_seq=owned.seq_base + snapshot.seq,
            due_at=owned.clock.due,
            suspended=suspended,
        )

    def unfreeze(self, session_id: str, epoch: int) -> None:
        """The handoff was aborted: the session continues here, now at ``epoch``."""
        owned = self.owned.get(session_id)
        if owned is None:
            return
        owned.frozen = False
        moved_on, owned.epoch = epoch != owned.epoch, epoch
        log.info("session_unfrozen", session_id=session_id, epoch=epoch)
        if moved_on and self.engine.has_session(session_id):
            # The handoff failed after the registry moved the epoch: the session stays here
            # under a new epoch, and its viewers hear so before its next chunk.
            self._notify(
                session_id,
                owned,
                NoticeKind.PLACED,
                owned.seq_base + self.engine.next_seq(session_id),
                detail=f"a migration did not complete; continues on {self.worker_id}",
            )

    def adopt(
        self, frozen: FrozenSession, epoch: int, token_hash: str = "", owner_key: str = ""
    ) -> None:
        """A session handed to this worker (ownership already moved here at ``epoch``): its
        state into the engine, generated from ``frozen.next_seq`` (or parked, if suspended)."""
        snapshot = frozen.snapshot
        sid = snapshot.session_id
        self.engine.import_state(snapshot, suspended=frozen.suspended)
        owned = OwnedSession(
            epoch=epoch,
            seq_base=frozen.next_seq - snapshot.seq,
            clock=PlaybackClock(frozen.due_at),
            token_hash=token_hash,
            owner_key=owner_key,
        )
        self.owned[sid] = owned
        self._notify(
            sid, owned, NoticeKind.MIGRATED, frozen.next_seq, detail=f"now on {self.worker_id}"
        )
        log.info(
            "session_adopted",
            session_id=sid,
            epoch=epoch,
            next_seq=frozen.next_seq,
            suspended=frozen.suspended,
        )

    def _settle_boundaries(self) -> None:
        """What waits for a chunk boundary: deferred suspends, then deferred resumes (into the
        slots those freed), then boundary controls."""
        resident = set(self._resident())
        phases = self.engine.phases()
        for sid, owned in list(self.owned.items()):
            if owned.suspend_pending and sid in resident and phases.get(sid, 0) == 0:
                owned.suspend_pending = False
                self._suspend(sid, owned)
        for sid, owned in list(self.owned.items()):
            if owned.resume_waiting is not None and not owned.frozen:
                self._resume(sid, owned, owned.resume_waiting)
        if not self._boundary_controls:
            return
        phases = self.engine.phases()
        pending = []
        for sid, control in self._boundary_controls:
            if sid not in self.owned:
                control.reject(LookupError(f"no session {sid} on this worker"))
            elif phases.get(sid, 0) == 0:  # at a boundary, or suspended (not resident)
                _run_control(control, self._publish_status)
            else:
                pending.append((sid, control))
        self._boundary_controls = pending

    # -- passes ---------------------------------------------------------------------------------
    def _resident(self) -> list[str]:
        return self.engine.active_sessions()

    def _candidates(self) -> list[tuple[str, bool, float]]:
        phases = self.engine.phases()
        out = []
        now: float | None = None
        for sid, phase in phases.items():
            owned = self.owned.get(sid)
            if owned is None or owned.frozen:
                continue
            if phase == 0 and not self.engine.input_ready(sid):
                # A video session waits for its input chunk (an input frame wakes the loop).
                now = self.now() if now is None else now
                if owned.input_wait_since is None and now >= owned.clock.due - self._head_start():
                    owned.input_wait_since = now
                continue
            if owned.input_wait_since is not None:
                now = self.now() if now is None else now
                owned.clock.due += now - owned.input_wait_since
                owned.input_wait_since = None
            out.append((sid, phase == 0, owned.clock.due))
        return out

    def _head_start(self) -> float:
        """How long before its due time a chunk starts (``pacing.plan_pass``)."""
        return max(self.lead_s, self._estimate())

    def input_arrived(self) -> None:
        """A video session's input frame was put in its buffer (thread-safe; from the event
        loop): the loop re-plans, as the session may now start its chunk."""
        self.inbox.wake()

    def _estimate(self) -> float:
        """Expected chunk time if every resident session took each pass, at the step budget
        in force (a pass costs the same whatever a chunk's step count)."""
        batch = sum(1 for o in self.owned.values() if not o.frozen)
        estimate = ChunkEstimate(self.engine.steps + 1, self.pass_times.snapshot())
        return estimate.chunk_s(batch)

    def _run_pass(self, participants: list[str]) -> None:
        phases = self.engine.phases()
        batch = len(participants)
        expected_ms = self.pass_times.snapshot().get(batch)
        if expected_ms is not None:
            self._pass_ends_at = self.now() + expected_ms / 1000.0
            # Published before the pass runs: the event loop must see it during the pass.
            self._status = replace(self._status, pass_ends_at=self._pass_ends_at)
        started = time.perf_counter()
        try:
            results = self.engine.pass_step(participants)
        except PassOutOfMemory as exc:
            self._hand_back(exc)
            return
        pass_ms = (time.perf_counter() - started) * 1000.0
        if self.pass_floor_ms is not None:
            pass_ms = self._pace_to_floor(batch, pass_ms)
        self.pass_times.add(batch, pass_ms)
        for sid in participants:
            owned = self.owned.get(sid)
            if owned is None:
                continue
            if phases.get(sid, 0) == 0:  # this pass started its chunk
                owned.chunk_ms, owned.chunk_batch = 0.0, batch
            elif owned.chunk_batch != batch:
                owned.chunk_batch = -1
            owned.chunk_ms += pass_ms
        self._announce_prompts(participants)
        if results:
            self._deliver(results)

    def _hand_back(self, failed: PassOutOfMemory) -> None:
        """A pass ran out of memory and the engine let its sessions go: each goes back to
        pending in the registry, to be placed again (a worker with its recovery log continues
        it from its last chunk, and its viewers hear so); this worker goes on with the others,
        at the lower capacity its heartbeats now carry."""
        log.warning(
            "handed_back_out_of_memory",
            sessions=failed.sessions,
            capacity=failed.capacity,
            error=str(failed),
        )
        for sid in failed.sessions:
            owned = self.owned.get(sid)
            if owned is None:
                continue
            self.outbox.put(HandBack(sid, owned.epoch))
            self.drop(sid, reason="out_of_memory")

    def _announce_prompts(self, participants: list[str]) -> None:
        """Prompt changes that waited for their encoding and applied in this pass: the chunk in
        progress is the first under the new prompt."""
        for sid in participants:
            owned = self.owned.get(sid)
            if owned is None or owned.prompt_unannounced is None:
                continue
            if self.engine.prompt_applied(sid, owned.prompt_unannounced):
                owned.prompt_unannounced = None
                self._notify(
                    sid, owned, NoticeKind.PROMPT, owned.seq_base + self.engine.next_seq(sid)
                )

    def _pace_to_floor(self, batch: int, real_ms: float) -> float:
        """Emulation: stretch the pass to the emulated GPU's time for this batch."""
        assert self.pass_floor_ms is not None
        floor = self.pass_floor_ms(batch)
        if real_ms < floor:
            time.sleep((floor - real_ms) / 1000.0)
            self._slow_passes = 0
        else:
            self._slow_passes += 1
        keeping = self._slow_passes < 3  # a few slow passes in a row: say so
        if keeping != self.keeping_pace:
            self.keeping_pace = keeping
            log.warning(
                "emulation_pace",
                keeping_pace=keeping,
                batch=batch,
                real_pass_ms=round(real_ms, 2),
                emulated_pass_ms=round(floor, 2),
            )
        return max(real_ms, floor)

    def _deliver(self, results: list[ChunkResult]) -> None:
        done_at = self.now()
        for r in results:
            owned = self.owned.get(r.session_id)
            if owned is None:
                continue
            gen_ms = owned.chunk_ms or r.gen_ms
            seq = owned.seq_base + r.seq
            encoded = self.encoder.submit(r.frames, seq)
            if owned.chunk_batch == r.batch and r.steps == self.engine.full_steps:
                # Every pass of it at one batch size, at full steps. A chunk's time is its
                # passes and its encoding: the profile this worker measures (heartbeats) and
                # the scheduler's latency model (full steps; fewer scale by passes) see it
                # whole, once its encode ends (:meth:`_time_encodes`).
                self._timed_encodes.append(TimedEncode(encoded, r.batch, gen_ms))
            due = owned.clock.chunk_done(done_at, self.period_s)
            if self.on_chunk is not None:
                self.on_chunk(max(0.0, done_at - due))
            chunk = Chunk(
                session_id=r.session_id,
                seq=seq,
                worker_id=self.worker_id,
                epoch=owned.epoch,
                width=int(r.frames.shape[2]),
                height=int(r.frames.shape[1]),
                fps=playback_fps(int(r.frames.shape[0]), self.period_s),
                gen_ms=gen_ms,
                batch=r.batch,
                due_at=due,
                done_at=done_at,
                fmp4=b"",  # the encoder's, when it is done (OutChunk.chunk)
                steps=r.steps,
                input_seq=r.input_seq,
            )
            point = None
            if self.recovery_log and not owned.suspend_pending:
                point = self.engine.recovery_point(r.session_id)
            self.outbox.put(OutChunk(chunk, point, encoded))
        self._time_encodes()

    def _time_encodes(self) -> None:
        """The chunk times of the chunks whose encode ended (an encode that failed times
        nothing: its chunk is not published)."""
        pending = []
        for timed in self._timed_encodes:
            if not timed.encoded.done():
                pending.append(timed)
            elif timed.encoded.exception() is None:
                encode_ms = timed.encoded.result().encode_ms
                self.chunk_times.add(timed.batch, timed.gen_ms + encode_ms)
        self._timed_encodes = pending

    def _notify(
        self, sid: str, owned: OwnedSession, kind: NoticeKind, next_seq: int, detail: str = ""
    ) -> None:
        self.outbox.put(
            SessionNotice(
                session_id=sid,
                kind=kind,
                worker_id=self.worker_id,
                epoch=owned.epoch,
                next_seq=next_seq,
                detail=detail,
            )
        )

    def _publish_status(self) -> None:
        engine = self.engine
        suspended = tuple(engine.suspended_sessions())
        status = LoopStatus(
            sessions=tuple(sorted(self.owned)),
            active=tuple(engine.active_sessions()),
            suspended=suspended,
            frozen=tuple(sid for sid, o in self.owned.items() if o.frozen),
            waiting=self._waiting,
            lead_ms=_frozen_map(
                {
                    sid: round(o.clock.last_lead_ms, 1)
                    for sid, o in self.owned.items()
                    if o.clock.last_lead_ms is not None
                }
            ),
            keeping_pace=self.keeping_pace,
            facts=_frozen_map(
                {
                    sid: SessionFacts(
                        epoch=o.epoch,
                        last_seq=o.seq_base + engine.next_seq(sid) - 1,
                        prompt=engine.prompt_of(sid),
                        seed=engine.seed_of(sid),
                        suspended=sid in suspended,
                        token_hash=o.token_hash,
                        owner_key=o.owner_key,
                        input=engine.input_of(sid),
                        strength=engine.strength_of(sid),
                    )
                    for sid, o in self.owned.items()
                    if engine.has_session(sid)
                }
            ),
            chunk_ms=_frozen_map(self.chunk_times.snapshot()),
            pass_ms=_frozen_map(self.pass_times.snapshot()),
            prompt_switch_ms=engine.prompt_switch_ms(),
            pass_ends_at=self._pass_ends_at,
            steps=engine.steps,
            capacity=engine.capacity,
        )
        self._status = status  # one reference swap: readers see the old or the new, whole


def _run_control(control: Control[Any], publish_status: Callable[[], None]) -> None:
    """Run a control; the status the event loop reads (admission, heartbeats) shows its effect
    before its caller hears it is done (a handed-off session is gone from it by the time the
    migration is reported, so a move straight back is not refused as a duplicate)."""
    try:
        result = control.run()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
        control.reject(exc)
    else:
        publish_status()
        control.resolve(result)


def _ignore(_: object) -> None:
    return None

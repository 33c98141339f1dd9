"""The generation loop on the real tiny engine, with a sink that drains its outbox (as the
event loop does) and records what it would publish."""

from __future__ import annotations

import threading
import time

from services.gpu_worker.engine import RecoveryPoint
from services.gpu_worker.generation import GenerationLoop
from services.gpu_worker.handoff.host import FrozenSession
from services.gpu_worker.inbox import CommandInbox, Control
from services.gpu_worker.outbox import Forget, HandBack, OutChunk, Outgoing
from shared.wire import Chunk, NoticeKind, SessionNotice, WorkerCmdKind, WorkerCommand
from tests.eventually import eventually_sync

from .conftest import make_engine


class RecordingSink:
    """Drains the loop's outbox on a thread of its own (the event loop's part); a session in
    ``fenced`` is refused as the registry would refuse its progress record."""

    def __init__(self, loop: GenerationLoop, fenced: set[str] | None = None) -> None:
        self.loop = loop
        self.items: list[Outgoing] = []
        self.fenced = fenced or set()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._drain_forever, daemon=True).start()

    def _drain_forever(self) -> None:
        while not self._stop.wait(0.005):
            self.pump()

    def pump(self) -> None:
        with self.lock:
            for item in self.loop.outbox.take():
                if isinstance(item, OutChunk) and item.chunk.session_id in self.fenced:
                    self.loop.fence(item.chunk.session_id, item.chunk.epoch)
                    continue
                self.items.append(item)

    def chunks(self, sid: str) -> list[Chunk]:
        self.pump()
        with self.lock:
            return [
                i.chunk for i in self.items if isinstance(i, OutChunk) and i.chunk.session_id == sid
            ]

    def notices(self, sid: str) -> list[SessionNotice]:
        self.pump()
        with self.lock:
            return [i for i in self.items if isinstance(i, SessionNotice) and i.session_id == sid]

    @property
    def handed_back(self) -> list[tuple[str, int]]:
        self.pump()
        with self.lock:
            return [(i.session_id, i.epoch) for i in self.items if isinstance(i, HandBack)]

    @property
    def points(self) -> dict[str, RecoveryPoint]:
        """Per session, the recovery point of its latest chunk that carried one."""
        self.pump()
        with self.lock:
            return {
                i.chunk.session_id: i.recovery
                for i in self.items
                if isinstance(i, OutChunk) and i.recovery is not None
            }

    @property
    def forgotten(self) -> list[str]:
        self.pump()
        with self.lock:
            return [i.session_id for i in self.items if isinstance(i, Forget)]


def _assign(sid: str, epoch: int, seq: int = 0, seed: int = 1) -> WorkerCommand:
    return WorkerCommand(
        kind=WorkerCmdKind.ASSIGN,
        worker_id="w",
        epoch=epoch,
        session_id=sid,
        prompt="a fox",
        seed=seed,
        seq=seq,
    )


def _run(loop: GenerationLoop, until, timeout: float = 30.0) -> None:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        eventually_sync(until, timeout, "the loop's outcome", interval=0.01)
    finally:
        loop.inbox.close()
        thread.join(10)


def _loop(engine=None, **kw) -> GenerationLoop:
    kw.setdefault("period_s", 0.0)
    kw.setdefault("lead_s", 0.0)
    return GenerationLoop(engine or make_engine(), CommandInbox(), worker_id="w", **kw)


def test_a_backlog_of_assigns_makes_one_generation_under_the_latest_epoch():
    loop = _loop()
    sink = RecordingSink(loop)
    for epoch in range(1, 39):
        loop.inbox.put(_assign("s", epoch))
    _run(loop, lambda: len(sink.chunks("s")) >= 3)
    chunks = sink.chunks("s")
    assert {c.epoch for c in chunks} == {38}
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [(n.kind, n.epoch) for n in sink.notices("s")] == [(NoticeKind.PLACED, 38)]
    assert loop.inbox.dropped_stale == 37


def test_a_continued_session_without_state_is_announced_as_restarted():
    loop = _loop()
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 4, seq=17))
    _run(loop, lambda: len(sink.chunks("s")) >= 1)
    (notice,) = sink.notices("s")
    assert notice.kind is NoticeKind.RESTARTED and notice.next_seq == 17
    assert sink.chunks("s")[0].seq == 17


def test_a_reassignment_at_its_own_seq_keeps_the_state():
    loop = _loop()
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 1))
    _run(loop, lambda: len(sink.chunks("s")) >= 2)
    loop.inbox = CommandInbox()
    next_seq = sink.chunks("s")[-1].seq + 1
    loop.inbox.put(_assign("s", 2, seq=next_seq))
    _run(loop, lambda: len(sink.chunks("s")) >= next_seq + 2)
    seqs = [c.seq for c in sink.chunks("s")]
    assert seqs == list(range(len(seqs)))
    # no restart; the new epoch is announced before its first chunk, from that chunk's seq
    assert [(n.kind, n.epoch) for n in sink.notices("s")] == [
        (NoticeKind.PLACED, 1),
        (NoticeKind.PLACED, 2),
    ]
    assert sink.notices("s")[-1].next_seq == next_seq
    assert sink.chunks("s")[-1].epoch == 2


def test_fenced_sessions_are_dropped_and_a_full_engine_hands_back():
    loop = _loop(make_engine(max_sessions=1))
    sink = RecordingSink(loop, fenced={"gone"})
    loop.inbox.put(_assign("gone", 1))
    _run(loop, lambda: "gone" in sink.forgotten)  # dropped once its record was refused
    assert "gone" not in loop.owned and loop.status().sessions == ()
    assert sink.chunks("gone") == []
    loop.inbox = CommandInbox()
    loop.inbox.put(_assign("kept", 1))
    loop.inbox.put(_assign("extra", 1))
    _run(loop, lambda: sink.handed_back)
    assert sink.handed_back == [("extra", 1)]


def test_a_record_refused_while_frozen_leaves_the_session_to_its_handoff():
    """The last chunk's progress record can land after the handoff froze the session and moved
    its epoch on: the refusal must not drop it, so an aborted handoff finds it to unfreeze."""
    loop = _loop()
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 1))
    frozen: list[FrozenSession] = []
    applied = threading.Event()
    unfrozen: list[None] = []
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        eventually_sync(lambda: sink.chunks("s"), 30, "a first chunk")
        freeze = Control("freeze", lambda: loop.freeze("s", 1), frozen.append, print, "s")
        loop.inbox.put(freeze)
        eventually_sync(lambda: frozen, 30, "the freeze at the chunk boundary")
        loop.fence("s", 1)  # the refusal of the last chunk's record, after the freeze
        loop.inbox.put(Control("after the fence", lambda: None, lambda _: applied.set(), print))
        eventually_sync(applied.is_set, 30, "the fence applied")
        assert loop.status().frozen == ("s",), "the refused record dropped the frozen session"
        before = len(sink.chunks("s"))
        # the handoff aborts after the registry moved the session to epoch 3
        loop.inbox.put(Control("unfreeze", lambda: loop.unfreeze("s", 3), unfrozen.append, print))
        eventually_sync(lambda: len(sink.chunks("s")) > before, 30, "chunks after the abort")
    finally:
        loop.inbox.close()
        thread.join(10)
    resumed = sink.chunks("s")[before]
    assert (resumed.epoch, resumed.seq) == (3, frozen[0].next_seq)


def test_a_control_is_answered_only_once_the_status_shows_its_effect():
    """A handed-off session is dropped by a control; admission reads the status, so the status
    must no longer list it when the control's caller hears it is done (or a move straight back
    would be refused as a duplicate)."""
    loop = _loop(period_s=0.5, lead_s=0.0)  # paced: passes wait, the status is not redone
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 1))
    seen: list[tuple[str, ...]] = []
    done = threading.Event()

    def answered(_value: object) -> None:
        seen.append(loop.status().sessions)
        done.set()

    def drop_once_playing() -> bool:
        if not sink.chunks("s"):
            return False
        if not loop.inbox.closed and not done.is_set() and not seen:
            seen.append(("asked",))
            loop.inbox.put(
                Control(
                    "release",
                    lambda: loop.drop("s", reason="migrated"),
                    answered,
                    lambda exc: done.set(),
                )
            )
        return done.is_set()

    _run(loop, drop_once_playing)
    assert seen[-1] == ()  # "s" was already gone from the status when the answer came


def test_playback_starts_when_the_assignment_or_resume_reached_the_worker():
    """A command that arrives during a pass is applied at the next boundary; the session's
    clock starts at its arrival, so the wait for the boundary counts in its first chunk's
    lateness (as the simulator counts it), on assignment and on every resume."""
    now = [100.0]
    loop = _loop(clock=lambda: now[0])
    loop.inbox.put(_assign("s", 1))  # arrives at 100.0 by the loop's clock
    now[0] = 100.3  # a pass in flight ends: the boundary where it is applied
    for item, arrived in loop.inbox.take_timed(0):
        assert arrived == 100.0
        loop._apply(item, arrived)  # noqa: SLF001 - the step the thread takes at a boundary
    assert loop.owned["s"].clock.due == 100.0

    loop._apply(
        WorkerCommand(
            kind=WorkerCmdKind.SUSPEND,
            worker_id="w",
            epoch=1,  # noqa: SLF001
            session_id="s",
        ),
        101.0,
    )
    now[0] = 105.4
    loop._apply(
        WorkerCommand(
            kind=WorkerCmdKind.RESUME,
            worker_id="w",
            epoch=1,  # noqa: SLF001
            session_id="s",
        ),
        105.2,
    )
    assert loop.owned["s"].clock.due == 105.2


def test_a_resume_that_finds_every_slot_taken_waits_for_one_to_free():
    """The scheduler counts a session as gone when it decides to suspend it; the worker frees its
    slot only at its chunk boundary. A resume that comes in between finds no slot: it waits
    (no RESUMED yet) and goes through at the first boundary with one free, its clock from the
    request."""
    now = [50.0]
    loop = _loop(make_engine(max_sessions=1), clock=lambda: now[0])
    sink = RecordingSink(loop)

    def cmd(kind: WorkerCmdKind, sid: str) -> WorkerCommand:
        return WorkerCommand(kind=kind, worker_id="w", epoch=1, session_id=sid)

    loop._apply(_assign("a", 1), 50.0)  # noqa: SLF001 - the thread's step at a boundary
    loop._apply(cmd(WorkerCmdKind.SUSPEND, "a"), 50.1)  # noqa: SLF001
    loop._apply(_assign("b", 1), 50.2)  # noqa: SLF001 - takes the only slot
    now[0] = 51.3  # the RESUME came at 51.0, during a pass
    loop._apply(cmd(WorkerCmdKind.RESUME, "a"), 51.0)  # noqa: SLF001
    loop._settle_boundaries()  # noqa: SLF001 - still no slot
    assert loop.owned["a"].resume_waiting == 51.0 and "a" in loop.engine.suspended_sessions()
    assert NoticeKind.RESUMED not in [n.kind for n in sink.notices("a")]
    assert not sink.handed_back

    now[0] = 52.0
    loop._apply(cmd(WorkerCmdKind.SUSPEND, "b"), 52.0)  # noqa: SLF001 - b leaves its slot
    loop._settle_boundaries()  # noqa: SLF001
    assert "a" not in loop.engine.suspended_sessions() and loop.owned["a"].resume_waiting is None
    assert sink.notices("a")[-1].kind is NoticeKind.RESUMED
    assert loop.owned["a"].clock.due == 51.0  # the wait counts in its first chunk's lateness


def test_a_pause_cancels_a_resume_that_waits_for_a_slot():
    loop = _loop(make_engine(max_sessions=1))

    def cmd(kind: WorkerCmdKind, sid: str) -> WorkerCommand:
        return WorkerCommand(kind=kind, worker_id="w", epoch=1, session_id=sid)

    loop._apply(_assign("a", 1))  # noqa: SLF001
    loop._apply(cmd(WorkerCmdKind.SUSPEND, "a"))  # noqa: SLF001
    loop._apply(_assign("b", 1))  # noqa: SLF001
    loop._apply(cmd(WorkerCmdKind.RESUME, "a"))  # noqa: SLF001
    loop._apply(cmd(WorkerCmdKind.SUSPEND, "a"))  # noqa: SLF001 - paused again meanwhile
    loop._apply(cmd(WorkerCmdKind.SUSPEND, "b"))  # noqa: SLF001
    loop._settle_boundaries()  # noqa: SLF001
    assert "a" in loop.engine.suspended_sessions() and loop.owned["a"].resume_waiting is None


def test_a_chunk_carries_as_much_video_as_its_period():
    from services.gpu_worker.encoder import FPS, playback_fps

    assert playback_fps(12, 1.25) == 9.6 and playback_fps(9, 1.25) == 7.2  # the emulated H20
    assert playback_fps(12, 0.75) == 16.0
    assert playback_fps(12, 0.0) == FPS  # unpaced
    loop = _loop(period_s=0.25, lead_s=0.25)
    sink = RecordingSink(loop)
    loop.inbox.put(_assign("s", 1))
    _run(loop, lambda: len(sink.chunks("s")) >= 2)
    for chunk in sink.chunks("s"):
        assert abs(chunk.duration_s - 0.25) < 1e-9  # its duration is the period


def test_a_prompt_still_encoding_is_announced_at_the_chunk_it_really_starts():
    """With umT5 a prompt change applies at the first boundary after its encoding finished;
    the PROMPT notice (the viewer's ack) comes then, naming that chunk, and that chunk and every
    later one follow the new prompt."""
    from services.gpu_worker.engine.prompts import PromptEncoder

    from .test_prompts import GatedEncoder

    loop = _loop()
    sink = RecordingSink(loop)
    gated = GatedEncoder(loop.engine.text_encoder)
    gated.gate.set()
    loop.engine.prompts = PromptEncoder(gated)
    loop.inbox.put(_assign("s", 1))
    state = {"asked_at": None}

    def prompt_then_release() -> bool:
        chunks = sink.chunks("s")
        if len(chunks) >= 2 and state["asked_at"] is None:
            gated.gate.clear()
            state["asked_at"] = len(chunks)
            loop.inbox.put(
                WorkerCommand(
                    kind=WorkerCmdKind.PROMPT,
                    worker_id="w",
                    epoch=1,
                    session_id="s",
                    prompt="a whale",
                )
            )
        if state["asked_at"] is not None and len(chunks) >= state["asked_at"] + 3:
            gated.gate.set()  # the encoding finishes three chunks later
        return any(n.kind is NoticeKind.PROMPT for n in sink.notices("s"))

    _run(loop, prompt_then_release)
    (notice,) = [n for n in sink.notices("s") if n.kind is NoticeKind.PROMPT]
    assert notice.next_seq >= state["asked_at"] + 3  # not the seq it was asked at
    assert loop.engine.prompt_applied("s", "a whale")


def test_a_full_outbox_holds_back_passes_and_loses_no_chunk():
    """Nobody drains the outbox (the event loop is behind): the loop stops running passes at
    the bound, keeps applying commands meanwhile, and goes on when the outbox is taken, with
    every chunk in order."""
    loop = _loop(outbox_chunks=2)
    loop.inbox.put(_assign("s", 1))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    taken: list[Outgoing] = []
    try:

        def two_chunks() -> bool:
            facts = loop.status().facts.get("s")
            return facts is not None and facts.last_seq >= 1

        eventually_sync(two_chunks, 30, "two chunks", interval=0.01)
        time.sleep(0.5)  # the wait is the test: time for many more passes, had they run
        assert loop.status().facts["s"].last_seq == 1
        assert len(loop.outbox) == 3  # the PLACED notice and two chunks
        answered = threading.Event()
        loop.inbox.put(Control("ping", lambda: None, lambda _: answered.set(), lambda _: None))
        assert answered.wait(10), "a command waited for the outbox"

        def six_chunks_taken() -> bool:
            taken.extend(loop.outbox.take())
            return sum(isinstance(i, OutChunk) for i in taken) >= 6

        eventually_sync(six_chunks_taken, 30, "passes resumed", interval=0.01)
    finally:
        loop.inbox.close()
        thread.join(10)
    taken += loop.outbox.take()
    seqs = [i.chunk.seq for i in taken if isinstance(i, OutChunk)]
    assert seqs == list(range(len(seqs)))

"""The generation thread's inbox (waits that a command or a wake cuts short, stale commands
dropped) and its outbox (nothing dropped, room below its bound)."""

from __future__ import annotations

import threading
import time

from services.gpu_worker.inbox import CommandInbox, Control
from shared.wire import WorkerCmdKind, WorkerCommand


def _cmd(kind: WorkerCmdKind, epoch: int, sid: str = "s") -> WorkerCommand:
    return WorkerCommand(kind=kind, worker_id="w", epoch=epoch, session_id=sid)


def test_superseded_commands_are_dropped_in_order_the_rest_kept():
    inbox = CommandInbox()
    for epoch in range(1, 39):
        inbox.put(_cmd(WorkerCmdKind.ASSIGN, epoch))
    inbox.put(_cmd(WorkerCmdKind.PROMPT, 38))
    inbox.put(_cmd(WorkerCmdKind.ASSIGN, 5, sid="other"))
    inbox.put(_cmd(WorkerCmdKind.STOP, 1))  # a STOP is never stale
    taken = inbox.take(timeout=0)
    assert [(c.kind, c.epoch, c.session_id) for c in taken] == [
        (WorkerCmdKind.ASSIGN, 38, "s"),
        (WorkerCmdKind.PROMPT, 38, "s"),
        (WorkerCmdKind.ASSIGN, 5, "other"),
        (WorkerCmdKind.STOP, 1, "s"),
    ]
    assert inbox.dropped_stale == 37
    # A command for an older epoch arriving later is dropped too.
    inbox.put(_cmd(WorkerCmdKind.SUSPEND, 37))
    assert inbox.take(timeout=0) == []
    inbox.forget("s")
    inbox.put(_cmd(WorkerCmdKind.ASSIGN, 1))
    assert len(inbox.take(timeout=0)) == 1


def test_a_command_cuts_a_wait_short():
    inbox = CommandInbox()
    threading.Timer(0.1, inbox.put, args=(_cmd(WorkerCmdKind.ASSIGN, 1),)).start()
    started = time.monotonic()
    taken = inbox.take(timeout=30.0)
    assert len(taken) == 1 and time.monotonic() - started < 5.0


def test_close_wakes_a_waiter_and_controls_pass_through():
    inbox = CommandInbox()
    results = []
    inbox.put(Control("noop", lambda: 42, results.append, results.append))
    (control,) = inbox.take(timeout=0)
    assert isinstance(control, Control) and control.run() == 42
    threading.Timer(0.1, inbox.close).start()
    started = time.monotonic()
    assert inbox.take(timeout=None) == [] and inbox.closed
    assert time.monotonic() - started < 5.0


def test_a_wake_ends_a_wait_without_an_item_once():
    inbox = CommandInbox()
    inbox.wake()  # before the wait: the wait does not start
    started = time.monotonic()
    assert inbox.take(timeout=30) == []
    assert time.monotonic() - started < 10
    waker = threading.Timer(0.1, inbox.wake)
    waker.start()
    assert inbox.take(timeout=30) == []  # ended by the wake, not the timeout
    assert time.monotonic() - started < 10
    waker.join()


def test_the_outbox_holds_every_item_and_has_room_below_its_bound():
    from services.gpu_worker.outbox import Forget, Outbox, OutChunk
    from shared.wire import Chunk, SessionNotice

    outbox = Outbox(max_chunks=2)
    wakes: list[int] = []
    outbox.on_take = lambda: wakes.append(1)

    def chunk(seq: int) -> OutChunk:
        return OutChunk(
            Chunk(
                session_id="s",
                seq=seq,
                worker_id="w",
                epoch=1,
                width=8,
                height=8,
                fps=16.0,
                gen_ms=1.0,
                batch=1,
                due_at=0.0,
                done_at=0.0,
                fmp4=b"",
            )
        )

    outbox.put(SessionNotice(session_id="s", kind="placed", worker_id="w", epoch=1, next_seq=0))
    outbox.put(chunk(0))
    assert outbox.has_room()
    assert outbox.take()[1] == chunk(0) and wakes == []  # not held back: nobody to wake
    for seq in range(1, 4):  # past the bound: kept all the same
        outbox.put(chunk(seq))
    outbox.put(Forget("s"))
    assert not outbox.has_room() and len(outbox) == 4
    taken = outbox.take()
    assert [i.chunk.seq for i in taken if isinstance(i, OutChunk)] == [1, 2, 3]
    assert wakes == [1] and outbox.has_room() and len(outbox) == 0

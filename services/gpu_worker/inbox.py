"""The generation thread's inbox: commands from the event loop, applied at pass boundaries.

The generation thread waits on the inbox (never on a plain sleep), so a command that arrives
while every session is ahead of playback is applied at once, and one that arrives during a pass
is applied at the next pass boundary.

Each item keeps when it arrived (on the generation loop's clock): a session's playback starts
when its ASSIGN or RESUME reached the worker, not at the boundary where it was applied, so the
wait for that boundary counts in its first chunk's lateness, as the simulator counts it.

Stale commands are dropped before they are applied: the inbox remembers the highest epoch it
has seen per session, and a command whose epoch is lower than that was superseded while it
waited (a backlog of re-assignments never replays as a storm).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from shared.wire import WorkerCmdKind, WorkerCommand

T = TypeVar("T")


class Control(Generic[T]):
    """A request from the event loop that the generation thread must answer (freeze a session
    for a migration, adopt one, ...). ``run`` is called on the generation thread at a pass
    boundary, or, when ``session_id`` is given, at that session's next chunk boundary; its
    result goes to ``resolve`` and an exception to ``reject`` (both thread-safe callbacks)."""

    __slots__ = ("name", "run", "resolve", "reject", "session_id")

    def __init__(
        self,
        name: str,
        run: Callable[[], T],
        resolve: Callable[[T], None],
        reject: Callable[[BaseException], None],
        session_id: str | None = None,
    ) -> None:
        self.name = name
        self.run = run
        self.resolve = resolve
        self.reject = reject
        self.session_id = session_id


InboxItem = WorkerCommand | Control[Any]


class CommandInbox:
    """Thread-safe queue of commands and controls with stale-epoch dropping."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock  # the generation loop sets its own
        self._items: deque[tuple[InboxItem, float]] = deque()
        self._cond = threading.Condition()
        self._latest_epoch: dict[str, int] = {}
        self._closed = False
        self._woken = False
        self.dropped_stale = 0

    def put(self, item: InboxItem) -> None:
        with self._cond:
            if isinstance(item, WorkerCommand) and item.session_id is not None:
                sid = item.session_id
                self._latest_epoch[sid] = max(self._latest_epoch.get(sid, item.epoch), item.epoch)
            self._items.append((item, self.clock()))
            self._cond.notify()

    def take(self, timeout: float | None) -> list[InboxItem]:
        """Everything queued, oldest first, without superseded commands. Waits up to
        ``timeout`` seconds (None: until something arrives or the inbox is closed) when empty."""
        return [item for item, _ in self.take_timed(timeout)]

    def take_timed(self, timeout: float | None) -> list[tuple[InboxItem, float]]:
        """:meth:`take`, each item with when it arrived."""
        with self._cond:
            if not self._items and not self._closed and not self._woken:
                self._cond.wait(timeout)
            self._woken = False
            items = list(self._items)
            self._items.clear()
            fresh = [(item, at) for item, at in items if not self._superseded(item)]
            self.dropped_stale += len(items) - len(fresh)
            return fresh

    def forget(self, session_id: str) -> None:
        """The session left this worker: stop tracking its epoch."""
        with self._cond:
            self._latest_epoch.pop(session_id, None)

    def wake(self) -> None:
        """Ends the generation thread's current wait without an item (the event loop drained
        the outbox: passes held back may run again). Never blocks on that thread."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    def close(self) -> None:
        """Wakes the generation thread for good (shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def _superseded(self, item: InboxItem) -> bool:
        if not isinstance(item, WorkerCommand) or item.session_id is None:
            return False
        if item.kind is WorkerCmdKind.STOP:
            return False  # the session is over whatever its epoch
        return item.epoch < self._latest_epoch.get(item.session_id, item.epoch)

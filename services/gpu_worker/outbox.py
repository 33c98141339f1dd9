"""What the generation thread sends out, for the event loop to publish.

The generation thread puts chunks, notices and hand-backs here and goes on; it never waits on
the event loop. The event loop takes everything queued, in order, and publishes it.

Nothing is ever dropped and a put never blocks. The bound is on passes instead: while
``max_chunks`` or more chunks wait here, the generation thread runs no new pass (it keeps
applying commands, which may add notices), and each take wakes it. A pass completes at most one
chunk per resident session, so the queue never holds more than ``max_chunks`` plus one pass's
chunks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.gpu_worker.engine import RecoveryPoint
from shared.wire import Chunk, SessionNotice


@dataclass(frozen=True, slots=True)
class OutChunk:
    """A chunk to publish, then record with its recovery point (None: log nothing)."""

    chunk: Chunk
    recovery: RecoveryPoint | None = None


@dataclass(frozen=True, slots=True)
class HandBack:
    """A session this worker cannot take: back to pending in the registry, if still ours at
    ``epoch``."""

    session_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Forget:
    """The session left this worker: drop what the publisher keeps of it."""

    session_id: str


Outgoing = OutChunk | SessionNotice | HandBack | Forget


def _nothing() -> None:
    return None


class Outbox:
    """A thread-safe queue from the generation thread to the event loop."""

    def __init__(self, max_chunks: int) -> None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.max_chunks = max_chunks
        self._items: deque[Outgoing] = deque()
        self._chunks = 0
        self._lock = threading.Lock()
        # Set by the two sides: ``on_put`` wakes the event loop's publisher (it must not
        # block: call_soon_threadsafe), ``on_take`` wakes the generation thread when a take
        # made room.
        self.on_put: Callable[[], None] = _nothing
        self.on_take: Callable[[], None] = _nothing

    def put(self, item: Outgoing) -> None:
        with self._lock:
            self._items.append(item)
            if isinstance(item, OutChunk):
                self._chunks += 1
        self.on_put()

    def has_room(self) -> bool:
        """Whether the generation thread may run another pass."""
        with self._lock:
            return self._chunks < self.max_chunks

    def take(self) -> list[Outgoing]:
        """Everything queued, oldest first; wakes the generation thread if it was holding
        back passes."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            held_back = self._chunks >= self.max_chunks
            self._chunks = 0
        if held_back:
            self.on_take()
        return items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

"""What the generation thread sends out, for the event loop to publish.

The generation thread puts chunks, notices and hand-backs here and goes on; it never waits on
the event loop. The event loop takes everything queued, in order, and publishes it.

Nothing is ever dropped and a put never blocks. The bound is on passes instead: while
``max_chunks`` or more chunks wait here or in the encoders, the generation thread runs no new
pass (it keeps applying commands, which may add notices), and each take or finished encode that
makes room wakes it. A pass completes at most one chunk per resident session, so the queue and
the encoders never hold more than ``max_chunks`` plus one pass's chunks.

A chunk is put before its encode ends (:class:`OutChunk` holds the future of its fragment): the
order of the queue is the order of publication, so a session's chunks and notices go out in
the order the generation thread made them, however the encoder threads finish.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec

from services.gpu_worker.encoder import EncodedChunk
from services.gpu_worker.engine import RecoveryPoint
from shared.wire import Chunk, SessionNotice


@dataclass(frozen=True, slots=True)
class OutChunk:
    """A chunk to publish, then record with its recovery point (None: log nothing). ``head``:
    the chunk's facts; ``encoded``: its fragment, being encoded (None: ``head`` is whole)."""

    head: Chunk
    recovery: RecoveryPoint | None = None
    encoded: Future[EncodedChunk] | None = None

    @property
    def chunk(self) -> Chunk:
        """The whole chunk (waits for its encode; raises what the encode raised)."""
        if self.encoded is None:
            return self.head
        done = self.encoded.result()
        fragment = done.fragment
        return msgspec.structs.replace(
            self.head,
            fps=done.fps,
            fmp4=fragment.data,
            fmp4_mime=fragment.mime,
            start_s=fragment.start_s,
            duration_s=fragment.duration_s,
            encode_ms=done.encode_ms,
        )

    def is_encoded(self) -> bool:
        return self.encoded is None or self.encoded.done()


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


@dataclass(frozen=True, slots=True)
class Flushed:
    """A marker: when the publisher reaches it, everything put before it is out (published, or
    told as unpublished). ``done`` is an event-loop future the publisher resolves."""

    done: asyncio.Future[None]


Outgoing = OutChunk | SessionNotice | HandBack | Forget | Flushed


def _nothing() -> None:
    return None


class Outbox:
    """A thread-safe queue from the generation thread to the event loop."""

    def __init__(self, max_chunks: int) -> None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.max_chunks = max_chunks
        self._items: deque[Outgoing] = deque()
        self._chunks = 0  # queued here
        self._encoding = 0  # taken, their encode not ended
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
            return self._chunks + self._encoding < self.max_chunks

    def take(self) -> list[Outgoing]:
        """Everything queued, oldest first; wakes the generation thread if that made room.
        A chunk still being encoded counts against the bound until its encode ends."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            held_back = self._chunks + self._encoding >= self.max_chunks
            encoding = [i for i in items if isinstance(i, OutChunk) and not i.is_encoded()]
            self._chunks = 0
            self._encoding += len(encoding)
            room = self._encoding < self.max_chunks
        for item in encoding:
            assert item.encoded is not None
            item.encoded.add_done_callback(self._encoded)
        if held_back and room:
            self.on_take()
        return items

    def _encoded(self, _: object) -> None:
        """A taken chunk's encode ended (on its encoder thread)."""
        with self._lock:
            held_back = self._chunks + self._encoding >= self.max_chunks
            self._encoding -= 1
            room = self._chunks + self._encoding < self.max_chunks
        if held_back and room:
            self.on_take()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

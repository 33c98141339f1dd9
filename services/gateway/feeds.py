"""Chunks of a session, fanned out from one JetStream subscription to every client watching it
on this gateway, each through its own bounded queue.

A :class:`Feed` reads the session's chunk subject once (an ordered consumer from the start of
what the stream retains) and keeps the recent entries in a ring, so that a client joining with
``Last-Event-ID`` gets what it missed and then the live chunks. A :class:`Viewer` is one client:
when it falls ``queue_chunks`` chunks behind, its queued chunks are dropped and it gets a
:class:`Lag` marker instead, so it skips to the live edge and never holds up anyone else.
A feed ends on the session's ``StreamEnd``, or when the registry says the session is over and
the stream has nothing more for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js import api as js_api

from services.gateway import errors
from services.gateway.chunkview import ChunkView, FeedMsg
from shared.logging import get_logger
from shared.registry import Registry
from shared.states import SessionState
from shared.streams import CHUNKS_PER_SESSION
from shared.wire import SessionNotice, StreamEnd, Subjects, decode_or_drop

log = get_logger("turboserve.gateway")

# Entries a feed keeps for clients that join late: the chunks the stream retains, plus notices.
RING_ENTRIES = 2 * CHUNKS_PER_SESSION
# A feed with no message for this long asks the registry whether its session is over; it asks
# again after twice as long each time (up to QUIET_CHECK_MAX_S) while nothing comes.
QUIET_CHECK_S = 1.0
QUIET_CHECK_MAX_S = 8.0
# The server drops a consumer whose gateway stopped reading it for this long.
CONSUMER_INACTIVE_S = 60.0


class Entry:
    """One chunk or notice, with its encodings cached: every client of a feed shares them."""

    __slots__ = ("item", "sse", "ws")

    def __init__(self, item: ChunkView | SessionNotice) -> None:
        self.item = item
        self.sse: bytes | None = None
        self.ws: Any = None


@dataclass(frozen=True, slots=True)
class Lag:
    """The client fell behind: these chunks were skipped; the next one is at the live edge."""

    skipped: int
    first_skipped: int
    last_skipped: int


@dataclass(frozen=True, slots=True)
class End:
    last_seq: int
    reason: str


class Viewer:
    """One client's queue. ``cursor`` is the highest chunk seq queued for it (chunks at or below
    it are never queued again: replays and a fenced worker's leftovers are skipped)."""

    def __init__(self, feed: Feed, last_seq: int, queue_chunks: int) -> None:
        self.feed = feed
        self.cursor = last_seq
        self.base_cap = queue_chunks
        self.cap = queue_chunks
        self.items: deque[Entry | Lag | End] = deque()
        self.queued_chunks = 0
        self.ended = False
        self.lags = 0
        self._wake = asyncio.Event()

    def offer(self, entry: Entry) -> None:
        if self.ended:
            return
        item = entry.item
        if isinstance(item, ChunkView):
            if item.seq <= self.cursor:
                return
            if self.queued_chunks >= self.cap:
                self._skip()
            self.cursor = item.seq
            self.queued_chunks += 1
        elif item.next_seq <= self.cursor:
            return  # it happened before what the client has (history being replayed)
        self.items.append(entry)
        self._wake.set()

    def _skip(self) -> None:
        dropped = [e.item.seq for e in self.items if isinstance(e, Entry) and isinstance(e.item, ChunkView)]
        kept: deque[Entry | Lag | End] = deque(
            e for e in self.items if not (isinstance(e, Entry) and isinstance(e.item, ChunkView))
        )
        kept.append(Lag(len(dropped), dropped[0], dropped[-1]))
        self.items = kept
        self.queued_chunks = 0
        self.cap = self.base_cap
        self.lags += 1

    def finish(self, end: End) -> None:
        if not self.ended:
            self.ended = True
            self.items.append(end)
            self._wake.set()

    def backlog(self, entries: list[Entry]) -> None:
        """Queue what the client missed; the queue grows to hold it all before the bound bites."""
        for entry in entries:
            self.cap = max(self.base_cap, self.queued_chunks + 1 + self.base_cap)
            self.offer(entry)

    async def next(self, within_s: float) -> Entry | Lag | End | None:
        """The next item, or None after ``within_s`` seconds with nothing."""
        while not self.items:
            self._wake.clear()
            try:
                async with asyncio.timeout(within_s):  # no task per wait, unlike wait_for
                    await self._wake.wait()
            except TimeoutError:
                return None
        item = self.items.popleft()
        if isinstance(item, Entry) and isinstance(item.item, ChunkView):
            self.queued_chunks -= 1
            if self.queued_chunks <= self.base_cap:
                self.cap = self.base_cap
        return item


class Feed:
    def __init__(self, hub: FeedHub, session_id: str) -> None:
        self.hub = hub
        self.session_id = session_id
        self.ring: deque[Entry] = deque(maxlen=RING_ENTRIES)
        self.viewers: set[Viewer] = set()
        self.top_seq = -1
        self.end: End | None = None
        self.next_quiet_check = time.monotonic() + QUIET_CHECK_S
        self.quiet_checks = 0
        self.started_at = time.time()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sub: Any = None

    async def start(self) -> None:
        hub = self.hub
        try:
            # A plain push consumer, no acks, no flow control, no heartbeats: the server pushes
            # what the stream retains, then each new message. (nats-py's ordered consumer runs
            # two polling tasks per subscription: a thousand watched sessions would keep the
            # loop busy with nothing to do.) The consumer goes when this gateway does.
            self._sub = await hub.js.subscribe(
                hub.subjects.chunks(self.session_id),
                stream=hub.subjects.chunks_stream,
                cb=self._on_msg,
                config=js_api.ConsumerConfig(
                    ack_policy=js_api.AckPolicy.NONE, mem_storage=True, num_replicas=1,
                ),
                deliver_policy=js_api.DeliverPolicy.ALL,
                inactive_threshold=CONSUMER_INACTIVE_S,
            )
        except Exception as exc:
            self.ready.set_exception(exc)
            self.ready.exception()  # retrieved: joiners re-raise it themselves
            raise
        self.ready.set_result(None)

    async def _on_msg(self, msg: Any) -> None:
        item = decode_or_drop(msg.subject, msg.data, FeedMsg, log)
        self.next_quiet_check = time.monotonic() + QUIET_CHECK_S
        self.quiet_checks = 0
        if item is None or self.end is not None:
            return
        if isinstance(item, StreamEnd):
            self.hub.finish(self, End(max(item.last_seq, self.top_seq), item.reason))
            return
        if item.session_id != self.session_id:
            return
        entry = Entry(item)
        self.ring.append(entry)
        if isinstance(item, ChunkView) and item.seq > self.top_seq:
            self.top_seq = item.seq
            if item.done_at >= self.started_at - 1.0:  # live, not history being replayed
                self.hub.on_chunk(item)
        for viewer in self.viewers:
            viewer.offer(entry)

    def add(self, last_seq: int) -> Viewer:
        viewer = Viewer(self, last_seq, self.hub.queue_chunks)
        viewer.backlog(list(self.ring))
        if self.end is not None:
            viewer.finish(self.end)
        self.viewers.add(viewer)
        return viewer

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


class FeedHub:
    """This gateway's feeds, one per watched session."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, registry: Registry,
                 queue_chunks: int, on_chunk: Callable[[ChunkView], None]) -> None:
        self.js = js
        self.subjects = subjects
        self.registry = registry
        self.queue_chunks = queue_chunks
        self.on_chunk = on_chunk
        self.feeds: dict[str, Feed] = {}
        self.closed = False

    async def join(self, session_id: str, last_seq: int) -> Viewer:
        """A viewer of ``session_id`` that gets the chunks after ``last_seq``, then live ones."""
        if self.closed:
            raise RuntimeError("the feed hub is closed")
        feed = self.feeds.get(session_id)
        try:
            if feed is None:
                feed = self.feeds[session_id] = Feed(self, session_id)
                try:
                    await feed.start()
                except Exception:
                    if self.feeds.get(session_id) is feed:
                        del self.feeds[session_id]
                    raise
            else:
                await asyncio.shield(feed.ready)
        except (NatsError, TimeoutError) as exc:
            log.warning("feed_subscribe_failed", session_id=session_id, error=repr(exc))
            raise errors.Unavailable("the chunk stream is not answering; retry") from None
        return feed.add(last_seq)

    async def leave(self, viewer: Viewer) -> None:
        feed = viewer.feed
        feed.viewers.discard(viewer)
        if not feed.viewers:
            if self.feeds.get(feed.session_id) is feed:
                del self.feeds[feed.session_id]
            await feed.close()

    def finish(self, feed: Feed, end: End) -> None:
        """The session is over: every viewer gets ``end``; the feed takes no one new."""
        feed.end = end
        for viewer in feed.viewers:
            viewer.finish(end)
        if self.feeds.get(feed.session_id) is feed:
            del self.feeds[feed.session_id]

    async def check_quiet(self) -> None:
        """End the feeds of sessions that are over without a ``StreamEnd`` (it aged out of the
        stream, or was never sent): terminated (or gone) and either every chunk delivered or the
        feed quiet for two checks (a terminated session produces no new chunks)."""
        now = time.monotonic()
        quiet = [f for f in self.feeds.values() if now >= f.next_quiet_check and f.ready.done()
                 and f.end is None]
        if not quiet:
            return
        async with self.registry.r.pipeline(transaction=False) as pipe:
            for feed in quiet:
                pipe.hmget(self.registry.session_key(feed.session_id), "state", "last_seq")
            found = await pipe.execute()
        for feed, (state, last_seq) in zip(quiet, found, strict=True):
            feed.quiet_checks += 1
            feed.next_quiet_check = now + min(QUIET_CHECK_MAX_S, QUIET_CHECK_S * 2 ** feed.quiet_checks)
            if state is None:  # gone from the registry
                self.finish(feed, End(feed.top_seq, "closed"))
            elif state.decode() == SessionState.TERMINATED.value and (
                int(last_seq or -1) <= feed.top_seq or feed.quiet_checks >= 2
            ):
                self.finish(feed, End(max(feed.top_seq, int(last_seq or -1)), "closed"))

    async def run_quiet_checks(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await self.check_quiet()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=QUIET_CHECK_S / 2)

    async def close(self, reason: str = "gateway_shutdown") -> None:
        """End every viewer (with ``reason``) and close every subscription; idempotent."""
        self.closed = True
        feeds = list(self.feeds.values())
        self.feeds.clear()
        for feed in feeds:
            end = End(feed.top_seq, reason)
            feed.end = end
            for viewer in feed.viewers:
                viewer.finish(end)
            await feed.close()

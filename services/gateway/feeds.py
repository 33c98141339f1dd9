"""Chunks of a session, fanned out from one JetStream subscription to every client watching it
on this gateway, each through its own bounded queue.

A :class:`Feed` reads the session's chunk subject once, from the start of what the stream
retains (64 chunks, five minutes), then live. It keeps the last few chunks in a ring, so that a
client joining with a recent ``Last-Event-ID`` shares the feed and gets what it missed from the
ring; one asking for more than the ring holds gets a feed of its own, which replays the stream.
A :class:`Viewer` is one client: when it falls ``queue_chunks`` chunks behind the live edge, its
queued chunks are dropped and it gets a :class:`Lag` marker instead, so it skips ahead and never
holds up anyone else (what it asked to catch up on is delivered whole first).

What a feed relays is fenced: a chunk or notice from an owner the session has left (an epoch
below the highest seen) is dropped, as is one whose worker and epoch are not an owner the
registry gave the session (:mod:`owners`: cached per feed, read again only for an epoch newer
than the cache's), and a chunk whose fragment is not in the wire's compact form (it goes out
verbatim).

JPEG is made here, from the fragment, once per chunk for every JPEG viewer of the feed
(:mod:`jpegs`): started as the chunk arrives while the feed has a JPEG viewer, or on the first
JPEG viewer's demand for a chunk from the ring; a feed with no JPEG viewer decodes nothing. A feed ends on the session's ``StreamEnd``, or when the registry
says the session is over and the stream has nothing more for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js import api as js_api
from redis.exceptions import RedisError

from services.gateway import errors
from services.gateway.chunkview import ChunkView, FeedMsg, fragment_fault
from services.gateway.jpegs import JpegFrames, Jpegs
from services.gateway.owners import Owners
from shared.logging import get_logger
from shared.registry import Registry
from shared.states import SessionState
from shared.wire import SessionNotice, StreamEnd, Subjects, decode_or_drop

log = get_logger("turboserve.gateway")

# Chunks a shared feed keeps for clients that join late (memory: a thousand watched sessions
# hold a few thousand chunks); a client that wants older ones gets its own feed.
RING_CHUNKS = 8
# A feed with no message for this long asks the registry whether its session is over, or has
# chunks the feed never got (its consumer lost); it asks again after twice as long each time
# (up to QUIET_CHECK_MAX_S) while nothing comes: a lost consumer is found within that of the
# owner's next chunk. (A thousand quiet feeds: one pipelined read of 500 keys a second.)
QUIET_CHECK_S = 1.0
QUIET_CHECK_MAX_S = 2.0
# A session missing from the registry this long is over (a closed one stays there for an hour);
# less may be a Redis that restarted empty, whose owner writes the session back within seconds.
MISSING_FOR_S = 60.0
# The server drops a consumer whose gateway stopped reading it for this long.
CONSUMER_INACTIVE_S = 60.0
# How long a resubscription's ask for a consumer waits for JetStream.
RESUBSCRIBE_ASK_S = 2.0
# Feeds that take a new consumer at once after a NATS reconnection.
RESUBSCRIBE_AT_ONCE = 32
# A resubscription waits this long for the registry's owner before going on without it.
OWNER_READ_S = 2.0


class Entry:
    """One chunk or notice. ``ws`` caches its WebSocket message per stream format, ``sse`` its
    JPEG event: every client of a feed shares them (an fMP4 SSE event is cheap to make: the
    fragment is spliced in as it came). ``jpeg``: its JPEG frames, once a JPEG viewer wanted
    them."""

    __slots__ = ("item", "jpeg", "sse", "ws")

    def __init__(self, item: ChunkView | SessionNotice) -> None:
        self.item = item
        self.ws: dict[str, bytes | str] = {}
        self.sse: bytes | None = None
        self.jpeg: asyncio.Future[JpegFrames] | None = None

    def jpegs(self, maker: Jpegs) -> asyncio.Future[JpegFrames]:
        """This chunk's JPEG frames, made once (the first call starts them)."""
        assert isinstance(self.item, ChunkView)
        if self.jpeg is None:
            self.jpeg = maker.start(self.item.fragment_bytes())
        return self.jpeg


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
    it are never queued again, nor notices from before it). ``epoch`` is the owner epoch of the
    last chunk it was offered: a live notice of a newer owner always goes through, even when its
    ``next_seq`` is one the client has (a worker lost after publishing a chunk but before
    recording it: its successor makes that seq again, and the client must still hear of it)."""

    def __init__(self, feed: Feed, last_seq: int, queue_chunks: int, jpeg: bool = False) -> None:
        self.feed = feed
        self.jpeg = jpeg  # it takes JPEG frames: the feed makes them as chunks arrive
        self.cursor = last_seq
        self.epoch: int | None = None
        self.base_cap = queue_chunks
        self.cap = queue_chunks
        self.items: deque[Entry | Lag | End] = deque()
        self.queued_chunks = 0
        self.ended = False
        self.lags = 0
        self._wake = asyncio.Event()

    def offer(self, entry: Entry, catching_up: bool = False) -> None:
        """Queue ``entry``. ``catching_up``: it is history the client asked for; the queue
        grows to hold all of it before the bound bites again."""
        if self.ended:
            return
        item = entry.item
        if isinstance(item, ChunkView):
            self.epoch = item.epoch
            if item.seq <= self.cursor:
                return
            if catching_up:
                self.cap = max(self.cap, self.queued_chunks + 1 + self.base_cap)
            elif self.queued_chunks >= self.cap:
                self._skip()
            self.cursor = item.seq
            self.queued_chunks += 1
        elif item.next_seq <= self.cursor and (
            catching_up or self.epoch is None or item.epoch <= self.epoch
        ):
            return  # it happened before what the client has
        self.items.append(entry)
        self._wake.set()

    def _skip(self) -> None:
        dropped = [
            e.item.seq for e in self.items if isinstance(e, Entry) and isinstance(e.item, ChunkView)
        ]
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
    """One subscription to a session's chunks. ``shared``: the hub hands it to every client of
    the session on this gateway; a private one serves one client that asked for history."""

    def __init__(self, hub: FeedHub, session_id: str, shared: bool = True) -> None:
        self.hub = hub
        self.session_id = session_id
        self.shared = shared
        self.ring: deque[Entry] = deque()
        self.ring_chunks = 0
        self.viewers: set[Viewer] = set()
        self.jpeg_viewers = 0
        self.top_seq = -1
        self.top_epoch = -1  # the newest owner's epoch: an older one is fenced off
        self.owners = Owners(hub.registry, session_id)
        self.end: End | None = None
        # Replaying what the stream retained: clients take it whole (no lag skips).
        self.replaying = True
        self.next_quiet_check = time.monotonic() + QUIET_CHECK_S
        self.quiet_checks = 0
        self.missing_since: float | None = None  # when the registry was first seen without it
        # The owner's record when this feed last took a new consumer for want of chunks: it
        # takes another only once the owner records more (the stream may hold none of them).
        self.lost_at = -1
        self.started_at = time.time()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sub: Any = None
        self._resubscribing = asyncio.Lock()

    async def start(self, js: JetStreamContext | None = None) -> None:
        """Subscribe (through ``js``: the hub's, or its quicker one for a resubscription)."""
        hub = self.hub
        js = js or hub.js
        try:
            if not self.owners.reads:
                # Before the subscription: whatever it delivers later than this read and
                # from a newer owner sends the feed back to the registry.
                await self.owners.load()
            # A plain push consumer, no acks, no flow control, no heartbeats: the server pushes
            # what the stream retains, then each new message. (nats-py's ordered consumer runs
            # two polling tasks per subscription: a thousand watched sessions would keep the
            # loop busy with nothing to do.)
            self._sub = await js.subscribe(
                hub.subjects.chunks(self.session_id),
                stream=hub.subjects.chunks_stream,
                cb=self._on_msg,
                config=js_api.ConsumerConfig(
                    ack_policy=js_api.AckPolicy.NONE,
                    mem_storage=True,
                    num_replicas=1,
                ),
                deliver_policy=js_api.DeliverPolicy.ALL,
                inactive_threshold=CONSUMER_INACTIVE_S,
            )
        except Exception as exc:
            self.ready.set_exception(exc)
            self.ready.exception()  # retrieved: joiners re-raise it themselves
            raise
        self.ready.set_result(None)

    def covers(self, last_seq: int) -> bool:
        """Whether this feed can give a client everything after ``last_seq``."""
        if last_seq >= self.top_seq or self.replaying and self.ring_chunks == 0:
            return True
        oldest = next(e.item.seq for e in self.ring if isinstance(e.item, ChunkView))
        return oldest <= last_seq + 1

    async def _on_msg(self, msg: Any) -> None:
        catching_up = self.replaying
        if self.replaying and _pending(msg.reply) == 0:
            self.replaying = False  # the rest is live
        # cast: mypy reads a union written as a value as a UnionType, not a type to decode as.
        item = decode_or_drop(msg.subject, msg.data, cast("type[FeedMsg]", FeedMsg), log)
        self.next_quiet_check = time.monotonic() + QUIET_CHECK_S
        self.quiet_checks = 0
        if item is None or self.end is not None:
            return
        if isinstance(item, StreamEnd):
            self.hub.finish(self, End(max(item.last_seq, self.top_seq), item.reason))
            return
        if item.session_id != self.session_id or not self._admit(msg.subject, item):
            return
        if not await self._owned(msg.subject, item, catching_up):
            return
        entry = Entry(item)
        if self.jpeg_viewers and isinstance(item, ChunkView):
            entry.jpegs(self.hub.jpegs)  # under way before any viewer asks
        self._keep(entry)
        if isinstance(item, ChunkView) and item.seq > self.top_seq:
            self.top_seq = item.seq
            if item.done_at >= self.started_at - 1.0:  # live, not history being replayed
                self.hub.on_chunk(item)
        for viewer in self.viewers:
            viewer.offer(entry, catching_up)

    def _admit(self, subject: str, item: ChunkView | SessionNotice) -> bool:
        if item.epoch < self.top_epoch:
            log.warning(
                "stale_owner_dropped",
                subject=subject,
                epoch=item.epoch,
                current_epoch=self.top_epoch,
                worker_id=item.worker_id,
            )
            return False
        if isinstance(item, ChunkView):
            fault = fragment_fault(item.fmp4)
            if fault is not None:
                log.warning("bad_message_dropped", subject=subject, fault=fault)
                return False
        return True

    async def _owned(self, subject: str, item: ChunkView | SessionNotice, history: bool) -> bool:
        """Whether the worker and epoch ``item`` carries are an owner the registry gave the
        session. Only a newer epoch than the cache's waits for Redis: the callback runs one
        message at a time, so nothing behind it overtakes it."""
        owners = self.owners
        verdict = owners.verdict(item.worker_id, item.epoch, history)
        if verdict is None:
            verdict = await owners.admits(item.worker_id, item.epoch, history)
            if self.end is not None:
                return False  # ended while the registry answered
        if not verdict:
            self.hub.foreign_dropped += 1
            if self.hub.on_foreign is not None:
                self.hub.on_foreign()
            owner, epoch = owners.current
            log.warning(
                "foreign_owner_dropped",
                subject=subject,
                worker_id=item.worker_id,
                epoch=item.epoch,
                owner=owner,
                owner_epoch=epoch,
            )
            return False
        if isinstance(item, ChunkView):
            # Raised only for an owner the registry named: a forged epoch cannot fence off the
            # real owner's chunks.
            self.top_epoch = max(self.top_epoch, item.epoch)
        return True

    def _keep(self, entry: Entry) -> None:
        self.ring.append(entry)
        if isinstance(entry.item, ChunkView):
            self.ring_chunks += 1
        while self.ring_chunks > RING_CHUNKS:  # drop the oldest chunk and the notices before it
            if isinstance(self.ring.popleft().item, ChunkView):
                self.ring_chunks -= 1

    def add(self, last_seq: int, jpeg: bool = False) -> Viewer:
        viewer = Viewer(self, last_seq, self.hub.queue_chunks, jpeg)
        self.jpeg_viewers += jpeg
        for entry in self.ring:
            viewer.offer(entry, catching_up=True)
        if self.end is not None:
            viewer.finish(self.end)
        self.viewers.add(viewer)
        return viewer

    async def resubscribe(self) -> None:
        """After NATS came back (a restarted server lost its memory streams, and this feed's
        consumer with them), or its consumer was lost: a new consumer from what the stream
        holds now. What a viewer has already is skipped (by seq); what was published meanwhile
        is delivered. One at a time: a second call while one is under way does nothing."""
        if self._resubscribing.locked():
            return
        async with self._resubscribing:
            await self._resubscribe()

    async def _resubscribe(self) -> None:
        old, self._sub = self._sub, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()
        self.replaying = True
        self.ready = asyncio.get_running_loop().create_future()
        # What changed while NATS was away; the cache stays as it was if Redis is away too.
        with contextlib.suppress(RedisError, TimeoutError):
            await asyncio.wait_for(self.owners.load(), OWNER_READ_S)
        await self.start(self.hub.js_retry)

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            # Delete the consumer now rather than let it linger for CONSUMER_INACTIVE_S.
            with contextlib.suppress(Exception):
                await self.hub.js.delete_consumer(self.hub.subjects.chunks_stream, sub._consumer)


def _pending(reply: str | None) -> int:
    """Messages still pending for the consumer, from a JetStream delivery's reply subject
    (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``)."""
    if not reply:
        return 0
    try:
        return int(reply.rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return 0


class FeedHub:
    """This gateway's feeds: one shared feed per watched session, and the private ones."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        registry: Registry,
        queue_chunks: int,
        on_chunk: Callable[[ChunkView], None],
        jpegs: Jpegs | None = None,
        on_foreign: Callable[[], None] | None = None,
        js_retry: JetStreamContext | None = None,
    ) -> None:
        self.jpegs = jpegs or Jpegs(quality=80)
        self.js = js
        # What a resubscription asks through: best with a shorter timeout (RESUBSCRIBE_ASK_S):
        # while a JetStream cluster elects a leader every ask waits it out, and the feed asks
        # again at its next quiet check.
        self.js_retry = js_retry or js
        self.subjects = subjects
        self.registry = registry
        self.queue_chunks = queue_chunks
        self.on_chunk = on_chunk
        self.feeds: dict[str, Feed] = {}  # the shared ones, by session
        self.open: set[Feed] = set()  # every feed with a subscription
        self.closed = False
        self.foreign_dropped = 0  # messages from no owner the registry named, all feeds
        self.on_foreign = on_foreign

    async def join(self, session_id: str, last_seq: int, jpeg: bool = False) -> Viewer:
        """A viewer of ``session_id`` that gets the chunks after ``last_seq``, then live ones
        (``jpeg``: it takes JPEG frames)."""
        if self.closed:
            raise errors.Unavailable("gateway is shutting down; retry on another replica")
        try:
            feed = self.feeds.get(session_id)
            if feed is not None:
                await asyncio.shield(feed.ready)
                if not feed.covers(last_seq):
                    feed = await self._start(Feed(self, session_id, shared=False))
            else:
                feed = self.feeds[session_id] = Feed(self, session_id)
                try:
                    await self._start(feed)
                except BaseException:
                    if self.feeds.get(session_id) is feed:
                        del self.feeds[session_id]
                    raise
        except (NatsError, TimeoutError) as exc:
            log.warning("feed_subscribe_failed", session_id=session_id, error=repr(exc))
            raise errors.Unavailable("the chunk stream is not answering; retry") from None
        except RedisError as exc:  # the owner's first read
            log.warning("feed_owner_read_failed", session_id=session_id, error=repr(exc))
            raise errors.Unavailable("the registry is not answering; retry") from None
        return feed.add(last_seq, jpeg)

    async def _start(self, feed: Feed) -> Feed:
        await feed.start()
        self.open.add(feed)
        return feed

    async def leave(self, viewer: Viewer) -> None:
        feed = viewer.feed
        if viewer in feed.viewers:
            feed.jpeg_viewers -= viewer.jpeg
        feed.viewers.discard(viewer)
        if not feed.viewers:
            if self.feeds.get(feed.session_id) is feed:
                del self.feeds[feed.session_id]
            self.open.discard(feed)
            await feed.close()

    def finish(self, feed: Feed, end: End) -> None:
        """The session is over: every viewer gets ``end``; the feed takes no one new."""
        feed.end = end
        for viewer in feed.viewers:
            viewer.finish(end)
        if self.feeds.get(feed.session_id) is feed:
            del self.feeds[feed.session_id]

    async def resubscribe_all(self) -> None:
        """Every open feed takes a new consumer (after a NATS reconnection), RESUBSCRIBE_AT_ONCE
        at a time: while a JetStream cluster elects a leader, each waits out its timeout."""
        room = asyncio.Semaphore(RESUBSCRIBE_AT_ONCE)

        async def one(feed: Feed) -> None:
            async with room:
                await self._take_new_consumer(feed)

        feeds = [feed for feed in self.open if feed.end is None]
        await asyncio.gather(*(one(feed) for feed in feeds))
        log.info("feeds_resubscribed", feeds=len(feeds))

    async def check_quiet(self) -> None:
        """End the feeds of sessions that are over without a ``StreamEnd`` (it aged out of the
        stream, or was never sent): terminated (or gone) and either every chunk delivered or the
        feed quiet for two checks (a terminated session produces no new chunks). A quiet feed
        of a live session whose owner recorded a chunk it never got lost its consumer (the
        NATS node that held it died; the consumer lives on one node): it takes a new one."""
        now = time.monotonic()
        quiet = [f for f in self.open if now >= f.next_quiet_check and f.end is None]
        if not quiet:
            return
        async with self.registry.r.pipeline(transaction=False) as pipe:
            for feed in quiet:
                pipe.hmget(
                    self.registry.session_key(feed.session_id),
                    "state",
                    "last_seq",
                    "owner",
                    "epoch",
                )
            found = await pipe.execute()
        lost: list[Feed] = []
        for feed, (state, last_seq, owner, epoch) in zip(quiet, found, strict=True):
            if epoch is not None:  # the owner comes along for free: a quiet feed's cache current
                feed.owners.note(owner.decode() if owner else "", int(epoch))
            feed.quiet_checks += 1
            feed.next_quiet_check = now + min(
                QUIET_CHECK_MAX_S, QUIET_CHECK_S * 2**feed.quiet_checks
            )
            if state is None:  # gone from the registry: over, or Redis restarted empty
                if feed.missing_since is None:
                    feed.missing_since = now
                elif now - feed.missing_since >= MISSING_FOR_S:
                    self.finish(feed, End(feed.top_seq, "closed"))
                continue
            feed.missing_since = None
            recorded = int(last_seq) if last_seq is not None else -1
            if state.decode() == SessionState.TERMINATED.value:
                if recorded <= feed.top_seq or feed.quiet_checks >= 2:
                    self.finish(feed, End(max(feed.top_seq, recorded), "closed"))
            elif recorded > max(feed.top_seq, feed.lost_at):
                log.warning(
                    "feed_consumer_lost", session_id=feed.session_id, have=feed.top_seq,
                    recorded=recorded,
                )  # fmt: skip
                feed.quiet_checks, feed.lost_at = 0, recorded
                lost.append(feed)
        if lost:
            await asyncio.gather(*(self._take_new_consumer(feed) for feed in lost))

    async def _take_new_consumer(self, feed: Feed) -> None:
        try:
            await feed.resubscribe()
        except Exception as exc:  # noqa: BLE001 - tried again at the feed's next quiet check
            log.warning("feed_resubscribe_failed", session_id=feed.session_id, error=repr(exc))

    async def run_quiet_checks(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.check_quiet()
            except RedisError as exc:  # Redis away for a moment: the next check catches up
                log.warning("feed_end_check_failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=QUIET_CHECK_S / 2)

    async def close(self, reason: str = "gateway_shutdown") -> None:
        """End every viewer (with ``reason``) and close every subscription; idempotent."""
        self.closed = True
        self.jpegs.close()
        feeds = list(self.open)
        self.open.clear()
        self.feeds.clear()
        for feed in feeds:
            end = End(feed.top_seq, reason)
            feed.end = end
            for viewer in feed.viewers:
                viewer.finish(end)
            await feed.close()

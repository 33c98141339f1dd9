"""A migration's source puts out every chunk the session made before its freeze before the
handoff goes on, so that its viewers get the old owner's last chunk before the new owner's
``migrated`` notice (a chunk still being encoded at the freeze would otherwise follow it: the
viewer would hear of the new owner, then get a chunk of the old one).

The freeze puts a :class:`Flushed` marker in the outbox behind the session's chunks and waits
for the publisher to reach it. Here, on the real NATS: a chunk whose encode has not ended, then
the marker; the marker is not reached until the encode ends and the chunk is published; then the
source sends its offer on its own connection, the destination (another connection) answers with
its notice on the chunk subject, and the stream holds the chunk first."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future
from typing import cast

import nats
import pytest

from services.gpu_worker.encoder import EncodedChunk
from services.gpu_worker.fmp4 import Fragment
from services.gpu_worker.outbox import Flushed, Outbox, OutChunk
from services.gpu_worker.service import Publisher
from shared.runner import close_context, open_context
from shared.settings import WorkerSettings
from shared.streams import ensure_streams
from shared.video import ChunkRetention
from shared.wire import Chunk, ChunkStreamMsg, NoticeKind, SessionNotice, decode, encode
from tests.eventually import eventually
from tests.gateway.test_units import wire_chunk

pytestmark = pytest.mark.integration


async def test_a_frozen_sessions_last_chunk_goes_out_before_the_new_owners_notice(env):
    ctx = await open_context(WorkerSettings.from_env(env), "turboserve-test")
    other = await nats.connect(env["TURBOSERVE_NATS_URL"])
    publishing = None
    try:
        await ensure_streams(ctx.js, ctx.subjects, ChunkRetention.of(ctx.settings))
        await ctx.registry.create_session("s", "p", 1)
        assert (await ctx.registry.claim("s", "src", 0)).epoch == 1
        outbox = Outbox(8)
        publisher = Publisher(ctx, "src", outbox, lambda *_: None)
        publishing = asyncio.ensure_future(publisher.publish_forever())
        encoding: Future[EncodedChunk] = Future()
        outbox.put(OutChunk(wire_chunk(7, b""), None, encoding))  # made before the freeze
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        outbox.put(Flushed(done))  # the freeze
        await asyncio.sleep(0.3)
        assert not done.done(), "the marker was reached before the chunk ahead of it went out"
        encoding.set_result(EncodedChunk(Fragment(b"\0" * 64, "video/mp4", 0.0, 0.75, 1.0), 16, 1))
        await asyncio.wait_for(done, 5.0)

        # The handoff goes on: the offer on the source's connection; the destination adopts and
        # publishes its notice on its own.
        offers = await other.subscribe(f"{env['TURBOSERVE_SUBJECT_PREFIX']}.test.offer")
        await other.flush()
        await ctx.nc.publish(f"{env['TURBOSERVE_SUBJECT_PREFIX']}.test.offer", b"offer")
        await offers.next_msg(timeout=5.0)
        notice = SessionNotice(
            session_id="s",
            kind=NoticeKind.MIGRATED,
            worker_id="dst",
            epoch=3,
            next_seq=8,
            detail="now on dst",
        )
        await other.publish(ctx.subjects.chunks("s"), encode(notice))
        await other.flush()

        sub = await other.jetstream().subscribe(
            ctx.subjects.chunks("s"), stream=ctx.subjects.chunks_stream, ordered_consumer=True
        )
        got: list[object] = []

        async def both_in() -> bool:
            with contextlib.suppress(TimeoutError):
                msg = await sub.next_msg(timeout=0.5)
                got.append(
                    decode(msg.subject, msg.data, cast("type[ChunkStreamMsg]", ChunkStreamMsg))
                )
            return len(got) >= 2

        await eventually(both_in, 10, "the chunk and the notice in the stream")
    finally:
        if publishing is not None:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)
        await other.close()
        await close_context(ctx)
    order = [("chunk", m.seq) if isinstance(m, Chunk) else ("notice", m.kind) for m in got]
    assert order == [("chunk", 7), ("notice", NoticeKind.MIGRATED)]

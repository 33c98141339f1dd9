"""NATS restarted under running services: each reconnects by itself, streams resume, and the
session events published around the restart are kept by JetStream and acted on."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from typing import cast

import pytest

from services.scheduler.service import SchedulerService
from shared.runner import running
from shared.settings import SchedulerSettings
from shared.wire import SessionEvent, SessionEventKind, encode
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import worker_in_process
from tools.servers import free_port, nats_server_binary, probe_nats

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def start_nats(port: int, store) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_services_reconnect_and_streams_resume_after_a_nats_restart(
    infra, isolation, redis_client, tmp_path
):
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    nats = start_nats(port, tmp_path / "js")
    try:
        await eventually(lambda: probe_nats(url), 10, "nats-server up")
        env = {
            "TURBOSERVE_NATS_URL": url,
            "TURBOSERVE_REDIS_URL": infra.redis_url,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_METRICS_PORT": "-1",
            **isolation,
        }
        settings = SchedulerSettings.from_env(env, tick_s=0.25, worker_timeout_s=10.0)
        async with (
            worker_in_process(env, worker_id="w1", chunk_period_s=0.25) as (_, ctx, rx),
            running(SchedulerService(settings), settings),
        ):
            await create(ctx, "before")
            await eventually(lambda: len(rx.chunks["before"]) >= 3, 30, "chunks")
            nats.terminate()
            await asyncio.to_thread(nats.wait)
            await asyncio.sleep(1.0)  # the outage is the test: the services see the server gone
            nats = start_nats(port, tmp_path / "js")
            await eventually(lambda: probe_nats(url), 10, "nats-server up")
            # Published as soon as the server is back, before the scheduler has reconnected
            # (or while it does): JetStream keeps it for the scheduler's durable consumer.
            await ctx.registry.create_session("after", "p", 2)
            for _ in range(100):
                try:
                    await ctx.js.publish(
                        ctx.subjects.session_events,
                        encode(SessionEvent(session_id="after", kind=SessionEventKind.CREATED)),
                        timeout=1,
                    )
                    break
                except Exception:  # noqa: BLE001 - our own connection is still reconnecting
                    await asyncio.sleep(0.2)
            count = len(rx.chunks["before"])
            await eventually(
                lambda: len(rx.chunks["before"]) >= count + 4, 60, "the stream to resume"
            )
            await eventually(
                lambda: len(rx.chunks["after"]) >= 2, 60, "the session created after the restart"
            )
        for sid in ("before", "after"):
            seqs = rx.seqs(sid)
            assert sorted(set(seqs)) == list(range(max(seqs) + 1)), (sid, seqs)
    finally:
        nats.terminate()
        nats.wait()


async def create(ctx, sid: str) -> None:
    await ctx.registry.create_session(sid, "p", 1)
    await ctx.js.publish(
        ctx.subjects.session_events,
        encode(SessionEvent(session_id=sid, kind=SessionEventKind.CREATED)),
    )


async def test_a_chunk_refused_while_nats_is_away_is_told_once_it_is_back(
    infra, isolation, redis_client, tmp_path
):
    """NATS stopped: the client buffers what it can (those chunks go out again after the
    reconnection) and refuses the rest; each refused chunk is counted, and its notice, which
    cannot go out then, is kept and published once NATS is back (after the streams are
    declared again), before the session's next chunk."""
    from concurrent.futures import Future

    import nats as nats_py

    from services.gpu_worker.encoder import EncodedChunk
    from services.gpu_worker.fmp4 import Fragment
    from services.gpu_worker.outbox import Outbox, OutChunk
    from services.gpu_worker.service import Publisher
    from shared.runner import close_context, open_context
    from shared.settings import WorkerSettings
    from shared.wire import Chunk, ChunkStreamMsg, NoticeKind, SessionNotice, decode

    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    server = start_nats(port, tmp_path / "js")
    settings = WorkerSettings.from_env(
        {"TURBOSERVE_NATS_URL": url, "TURBOSERVE_REDIS_URL": infra.redis_url, **isolation}
    )

    def out(seq: int, size: int) -> OutChunk:
        head = Chunk(
            session_id="s",
            seq=seq,
            worker_id="w1",
            epoch=1,
            width=16,
            height=16,
            fps=16.0,
            gen_ms=1.0,
            batch=1,
            due_at=0.0,
            done_at=0.0,
            fmp4=b"",
        )
        encoded: Future[EncodedChunk] = Future()
        fragment = Fragment(bytes(size), "video/mp4", seq * 0.75, 0.75, 1.0)
        encoded.set_result(EncodedChunk(fragment, 16.0, 1.0))
        return OutChunk(head, None, encoded)

    try:
        await eventually(lambda: probe_nats(url), 10, "nats-server up")
        ctx = await open_context(settings, "turboserve-test")
        try:
            await ctx.registry.create_session("s", "p", 1)
            assert (await ctx.registry.claim("s", "w1", 0)).epoch == 1
            outbox = Outbox(16)
            publisher = Publisher(ctx, "w1", outbox, lambda *_: None)
            ctx.reconnect_hooks.append(publisher.republish)
            server.terminate()
            await asyncio.to_thread(server.wait)
            await eventually(lambda: not ctx.nc.is_connected, 10, "the client sees NATS gone")
            for seq in range(4):  # 700 KB each: the client's 2 MiB buffer takes two
                outbox.put(out(seq, 700_000))
            await publisher.publish_queued()
            assert publisher.unpublished == 2 and len(publisher._owed) == 2
            server = start_nats(port, tmp_path / "js")
            await eventually(lambda: not publisher._owed, 30, "the notices sent once NATS is back")
            outbox.put(out(4, 1000))
            await publisher.publish_queued()
            reader = await nats_py.connect(url)
            got: list[object] = []
            try:
                sub = await reader.jetstream().subscribe(
                    ctx.subjects.chunks("s"),
                    stream=ctx.subjects.chunks_stream,
                    ordered_consumer=True,
                )

                async def all_in() -> bool:
                    with contextlib.suppress(TimeoutError):
                        msg = await sub.next_msg(timeout=0.5)
                        got.append(
                            decode(
                                msg.subject, msg.data, cast("type[ChunkStreamMsg]", ChunkStreamMsg)
                            )
                        )
                    return any(isinstance(m, Chunk) and m.seq == 4 for m in got)

                await eventually(all_in, 30, "the stream holds what came after")
            finally:
                await reader.close()
        finally:
            await close_context(ctx)
    finally:
        server.terminate()
        server.wait()
    notices = [m for m in got if isinstance(m, SessionNotice)]
    assert [(n.kind, n.next_seq) for n in notices] == [
        (NoticeKind.UNPUBLISHED, 3),
        (NoticeKind.UNPUBLISHED, 4),
    ]
    # the buffered chunks went out again after the reconnection; the refused ones did not
    assert sorted({m.seq for m in got if isinstance(m, Chunk)}) == [0, 1, 4]

"""Nothing is dropped in silence: a chunk the worker cannot publish (NATS refuses it, or it could
not be encoded within its bound) reaches the viewer as an ``unpublished`` state notice, the
session goes on at the next seq, and the worker counts it (its metric, its heartbeat's count).

The worker's publisher runs here on the real NATS, past the start-up check that keeps a chunk
under the server's max_payload: a chunk over it is refused by the real client
(``MaxPayloadError``), as a worker told of a larger limit than the server's would see."""

from __future__ import annotations

from concurrent.futures import Future

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.gpu_worker.encoder import EncodedChunk
from services.gpu_worker.fmp4 import FragmentTooLarge
from services.gpu_worker.metrics import WorkerMetrics
from services.gpu_worker.outbox import Outbox, OutChunk
from services.gpu_worker.service import Publisher
from shared.wire import Chunk
from tests.eventually import eventually
from tests.gateway.conftest import bearer, create, fragment, read_sse

pytestmark = pytest.mark.integration

WORKER = "wfake"


def _out(sid: str, seq: int, data: bytes | None = None, fails: bool = False) -> OutChunk:
    """A chunk as the generation thread hands it over: its facts and its encode's future."""
    made = fragment(16, 16, 40 * seq % 255, 4)
    head = Chunk(
        session_id=sid,
        seq=seq,
        worker_id=WORKER,
        epoch=1,
        width=16,
        height=16,
        fps=16.0,
        gen_ms=5.0,
        batch=1,
        due_at=0.0,
        done_at=0.0,
        fmp4=b"",
    )
    encoded: Future[EncodedChunk] = Future()
    if fails:
        encoded.set_exception(FragmentTooLarge(300_000, 191_596))
    else:
        if data is not None:
            made = type(made)(data, made.mime, made.start_s, made.duration_s, made.encode_ms)
        encoded.set_result(EncodedChunk(fragment=made, fps=16.0, encode_ms=2.0))
    return OutChunk(head, None, encoded)


async def test_an_unpublished_chunk_is_told_counted_and_the_session_goes_on(http, gw):
    s = await create(http)
    sid = s["id"]
    assert (await gw.ctx.registry.claim(sid, WORKER, 0)).epoch == 1
    metrics = WorkerMetrics(CollectorRegistry())
    outbox = Outbox(8)
    publisher = Publisher(
        gw.ctx, WORKER, outbox, lambda *_: None, on_unpublished=metrics.chunks_unpublished.inc
    )
    over = gw.ctx.nc.max_payload + 1  # the real client refuses it: MaxPayloadError
    async with http.get(
        s["stream_url"], params={"format": "fmp4"}, headers=bearer(s["token"])
    ) as stream:

        async def watching() -> bool:
            return await gw.store.viewers(sid) >= 1

        await eventually(watching)
        for item in (
            _out(sid, 0),
            _out(sid, 1, data=b"\0" * over),
            _out(sid, 2),
            _out(sid, 3, fails=True),
            _out(sid, 4),
        ):
            outbox.put(item)
        await publisher.publish_queued()
        events = await read_sse(stream, want=5)
    got = [(e["event"], orjson.loads(e["data"])) for e in events]
    assert [(kind, data.get("seq", data.get("next_seq"))) for kind, data in got] == [
        ("chunk", 0),
        ("state", 2),
        ("chunk", 2),
        ("state", 4),
        ("chunk", 4),
    ]
    refused, unencoded = got[1][1], got[3][1]
    assert refused["kind"] == "unpublished" and refused["worker_id"] == WORKER
    assert "chunk 1 was not published" in refused["detail"] and "MaxPayload" in refused["detail"]
    assert unencoded["kind"] == "unpublished" and "within its bound" in unencoded["detail"]
    assert publisher.unpublished == 2
    assert b"turboserve_chunks_unpublished_total 2.0" in generate_latest(metrics.registry)

"""Pure pieces of the gateway: keys, settings, admission, the per-client queue, framing."""

from __future__ import annotations

import asyncio
import base64
import struct

import msgspec
import orjson
import pytest
import structlog

from services.gateway import errors
from services.gateway.admission import judge_pool
from services.gateway.auth import KeyRing, digest, new_session_token
from services.gateway.chunkview import ChunkView, FeedMsg, fragment_fault
from services.gateway.cluster import merge_latency, worker_load
from services.gateway.feeds import End, Entry, Lag, Viewer
from services.gateway.jpegs import JpegFrames
from services.gateway.sse import fragment_event, jpeg_event
from services.gateway.ws import frames_message
from shared.registry import PoolLimits, WorkerRecord
from shared.settings import GatewaySettings, SettingsError
from shared.wire import (
    Chunk,
    NoticeKind,
    SessionNotice,
    WorkerStatus,
    decode,
    decode_or_drop,
    encode,
)


def test_api_keys_from_the_list_the_file_and_the_legacy_token(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# one per line\nops:k-ops-1\n\nci: k-ci-2 \n")
    s = GatewaySettings.from_env(
        {
            "TURBOSERVE_API_KEYS": "alice:k-a, bob:k-b",
            "TURBOSERVE_API_KEYS_FILE": str(keys_file),
            "TURBOSERVE_API_TOKEN": "legacy",
        }
    )
    assert s.api_key_map() == {
        "alice": "k-a",
        "bob": "k-b",
        "ops": "k-ops-1",
        "ci": "k-ci-2",
        "default": "legacy",
    }
    text = str(s)
    assert "k-a" not in text and "legacy" not in text  # masked when printed


@pytest.mark.parametrize(
    ("env", "fault"),
    [
        ({"TURBOSERVE_API_KEYS": "nokey"}, "expected name:key"),
        ({"TURBOSERVE_API_KEYS": "a:1,a:2"}, "given twice"),
        ({"TURBOSERVE_API_KEYS": "bad name:1"}, "key name"),
        ({"TURBOSERVE_API_KEYS": "default:x", "TURBOSERVE_API_TOKEN": "y"}, "'default'"),
        ({"TURBOSERVE_API_KEYS_FILE": "/nonexistent/keys"}, "TURBOSERVE_API_KEYS_FILE"),
        ({"TURBOSERVE_IDLE_AFTER_S": "0"}, "TURBOSERVE_IDLE_AFTER_S"),
        ({"TURBOSERVE_CLIENT_QUEUE_CHUNKS": "0"}, "TURBOSERVE_CLIENT_QUEUE_CHUNKS"),
        ({"TURBOSERVE_OPERATOR_KEY": "a b"}, "TURBOSERVE_OPERATOR_KEY"),
    ],
)
def test_bad_key_and_lifetime_settings_are_named(env, fault):
    with pytest.raises(SettingsError, match=fault):
        GatewaySettings.from_env(env)


def test_keyring_names_keys_and_tells_the_operator_apart():
    ring = KeyRing.from_secrets({"alice": "k-a", "bob": "k-b"}, "op")
    assert ring.api_key_name("k-b") == "bob" and ring.api_key_name("k-") is None
    assert ring.is_operator("op") and not ring.is_operator("k-a")
    assert not ring.open and KeyRing.from_secrets({}, "").open
    assert not KeyRing.from_secrets({}, "").is_operator("")


def test_session_tokens_are_unguessable_and_stored_as_digests():
    tokens = {new_session_token() for _ in range(100)}
    assert len(tokens) == 100
    token, stored = next(iter(tokens))
    assert stored == digest(token) and token not in stored and len(token) >= 40


def worker(
    wid: str, capacity: int, held: int, status=WorkerStatus.READY, alive=True
) -> WorkerRecord:
    return WorkerRecord(
        id=wid,
        status=status,
        capacity=capacity,
        alive=alive,
        sessions=tuple(f"{wid}-s{i}" for i in range(held)),
    )


def test_pool_is_full_only_at_its_maximum_with_no_free_slot():
    limits = PoolLimits(min_workers=1, max_workers=2)
    full = [worker("a", 2, 2), worker("b", 2, 2)]
    assert judge_pool(full, limits, pending=0).full
    assert not judge_pool(full, None, pending=0).full  # no limits: the pool may grow
    assert not judge_pool(full[:1], limits, pending=0).full  # room for one more worker
    spare = [worker("a", 2, 1), worker("b", 2, 2)]
    assert not judge_pool(spare, limits, pending=0).full
    assert judge_pool(spare, limits, pending=1).full  # the free slot is spoken for
    booting = [worker("a", 2, 2), worker("b", 2, 0, status=WorkerStatus.BOOTING)]
    assert judge_pool(booting, limits, pending=0).full  # a booting worker has no slot yet
    dead = [worker("a", 2, 2), worker("b", 2, 0, alive=False)]
    assert not judge_pool(dead, limits, pending=0).full  # a dead one frees its place in the pool
    # placed since the last heartbeat: the placement map counts it already
    assert judge_pool(spare, limits, pending=0, placement={"new": "a"}).full
    assert not judge_pool(spare, limits, pending=0, placement={"a-s0": "a"}).full  # same one


def test_429_carries_retry_after_in_whole_seconds():
    resp = errors.PoolFull("full", retry_after_s=2.2).response()
    assert resp.status == 429 and resp.headers["Retry-After"] == "3"
    body = orjson.loads(resp.body)["error"]
    assert (
        body["code"] == "pool_full"
        and body["retryable"]
        and body["details"]["retry_after_s"] == 2.2
    )
    assert errors.RateLimited("x", retry_after_s=0.01).response().headers["Retry-After"] == "1"


def wire_chunk(seq: int, fmp4: bytes = b"\x00\x00\x00\x18ftyp", epoch: int = 1) -> Chunk:
    return Chunk(
        session_id="s",
        seq=seq,
        worker_id="w",
        epoch=epoch,
        width=4,
        height=2,
        fps=16.0,
        gen_ms=1.0,
        batch=1,
        due_at=10.0,
        done_at=10.5,
        fmp4=fmp4,
    )


def chunk(seq: int, fmp4: bytes = b"\x00\x00\x00\x18ftyp", epoch: int = 1) -> ChunkView:
    """A chunk as the gateway reads it off the wire."""
    return decode("s.chunks", encode(wire_chunk(seq, fmp4, epoch)), ChunkView)


def sse_data(event: bytes) -> dict:
    """An SSE event's data, its ``data:`` lines joined as a client joins them."""
    lines = [
        line.removeprefix(b"data: ") for line in event.split(b"\n") if line.startswith(b"data: ")
    ]
    return orjson.loads(b"\n".join(lines))


def test_chunk_view_is_the_wires_chunk_with_its_fragment_kept_as_text():
    wire = {f.name: f.type for f in msgspec.structs.fields(Chunk)}
    view = {f.name: f.type for f in msgspec.structs.fields(ChunkView)}
    assert view.pop("fmp4") is msgspec.Raw and wire.pop("fmp4") is bytes
    assert view == wire
    assert ChunkView.__struct_config__.tag == Chunk.__struct_config__.tag
    original = wire_chunk(3, b"\x00fragment")
    view_of = chunk(3, b"\x00fragment")
    for f in msgspec.structs.fields(Chunk):
        if f.name != "fmp4":
            assert getattr(view_of, f.name) == getattr(original, f.name), f.name
    assert view_of.fragment_bytes() == original.fmp4
    data = sse_data(fragment_event(view_of))
    assert base64.b64decode(data["fragment"]) == original.fmp4
    assert data["timing"]["latency_ms"] == 500.0 and data["seq"] == 3
    frames = [b"\xff\xd8one", b"two"]
    data = sse_data(jpeg_event(view_of, JpegFrames(frames)))
    assert [base64.b64decode(x) for x in data["frames"]] == frames
    assert data["encoding"] == "jpeg/base64" and data["seq"] == 3
    # a malformed message on the subject is dropped, never raised
    assert (
        decode_or_drop("s.chunks", b'{"type":"chunk","seq":"x"}', FeedMsg, structlog.get_logger())
        is None
    )


def notice(next_seq: int, kind: NoticeKind = NoticeKind.PROMPT, epoch: int = 1) -> SessionNotice:
    return SessionNotice(session_id="s", kind=kind, worker_id="w", epoch=epoch, next_seq=next_seq)


def drain(viewer: Viewer) -> list:
    async def run():
        out = []
        while (item := await viewer.next(0.0)) is not None:
            out.append(item)
        return out

    return asyncio.run(run())


def test_viewer_skips_to_the_live_edge_when_it_falls_behind():
    v = Viewer(feed=None, last_seq=-1, queue_chunks=3)  # type: ignore[arg-type]
    for seq in range(3):
        v.offer(Entry(chunk(seq)))
    v.offer(Entry(notice(3)))
    v.offer(Entry(chunk(3)))  # the fourth queued chunk: the three before it are dropped
    items = drain(v)
    assert isinstance(items[0], Entry) and items[0].item.kind is NoticeKind.PROMPT  # notices kept
    assert items[1] == Lag(skipped=3, first_skipped=0, last_skipped=2)
    assert items[2].item.seq == 3 and len(items) == 3 and v.lags == 1


def test_viewer_never_repeats_a_chunk_nor_replays_old_notices():
    v = Viewer(feed=None, last_seq=4, queue_chunks=8)  # type: ignore[arg-type]
    for entry in (
        Entry(notice(2)),
        Entry(chunk(3)),
        Entry(chunk(5)),
        Entry(notice(6)),
        Entry(chunk(6)),
    ):
        v.offer(entry, catching_up=True)
    v.offer(Entry(chunk(6)))  # a fenced worker's leftover
    v.finish(End(6, "closed"))
    v.offer(Entry(chunk(7)))  # nothing after the end
    items = drain(v)
    assert [type(i.item).__name__ if isinstance(i, Entry) else i for i in items] == [
        "ChunkView",
        "SessionNotice",
        "ChunkView",
        End(6, "closed"),
    ]
    assert [
        i.item.seq for i in items if isinstance(i, Entry) and isinstance(i.item, ChunkView)
    ] == [5, 6]


def test_a_new_owner_is_announced_even_from_a_seq_the_client_has():
    # The old worker published seq 5 and died before recording it: its successor (epoch 3)
    # makes seq 5 again. The viewer must hear of the new owner before its next chunk.
    v = Viewer(feed=None, last_seq=-1, queue_chunks=8)  # type: ignore[arg-type]
    for seq in range(6):
        v.offer(Entry(chunk(seq)))
    v.offer(Entry(notice(4, NoticeKind.PROMPT, epoch=1)))  # old news of the same owner: dropped
    v.offer(Entry(notice(5, NoticeKind.RECOVERED, epoch=3)))
    v.offer(Entry(chunk(5, epoch=3)))  # a repeat: never queued
    v.offer(Entry(chunk(6, epoch=3)))
    items = [i.item for i in drain(v)]
    kinds = [(type(i).__name__, getattr(i, "seq", None), i.epoch) for i in items]
    assert kinds[-2:] == [("SessionNotice", None, 3), ("ChunkView", 6, 3)]
    assert [i.seq for i in items if isinstance(i, ChunkView)] == list(range(7))
    assert sum(isinstance(i, SessionNotice) for i in items) == 1


def test_history_asked_for_is_delivered_whole_before_the_bound_applies():
    v = Viewer(feed=None, last_seq=-1, queue_chunks=2)  # type: ignore[arg-type]
    for i in range(10):
        v.offer(Entry(chunk(i)), catching_up=True)
    v.offer(Entry(chunk(10)))
    items = drain(v)
    assert [i.item.seq for i in items] == list(range(11))


def test_websocket_chunk_framing():
    frames = [b"\xff\xd8one", b"\xff\xd8second"]
    data = frames_message(chunk(7), JpegFrames(frames))
    (n,) = struct.unpack(">I", data[:4])
    header = orjson.loads(data[4 : 4 + n])
    assert header["type"] == "chunk" and header["seq"] == 7 and header["frame_sizes"] == [5, 8]
    assert header["timing"]["latency_ms"] == 500.0
    assert data[4 + n :] == b"".join(frames)


def test_worker_load_and_latency_merge():
    w = WorkerRecord(
        id="w1", status=WorkerStatus.READY, capacity=4, sessions=("a", "b", "c"), suspended=("c",)
    )
    assert worker_load(w, None) == 0.5
    assert worker_load(w, {"rho": {"w1": 0.9}}) == 0.9
    assert worker_load(w, {"rho": {"w1": "high"}}) == 0.5
    assert merge_latency({"a": [(1, 5.0), (2, 1.0)], "b": [(2, 7.0)]}) == [[1, 5.0], [2, 7.0]]


def test_a_fragment_is_relayed_only_in_the_wires_compact_form():
    good = msgspec.json.encode(b"\x00\x00\x00\x18ftyp")
    assert fragment_fault(msgspec.Raw(good)) is None
    assert "line break" in fragment_fault(msgspec.Raw(good[:3] + b"\n" + good[3:]))
    assert fragment_fault(msgspec.Raw(b'["QUJD"]')) is not None  # not a string
    assert fragment_fault(msgspec.Raw(b'"not base64!"')) is not None
    assert fragment_fault(msgspec.Raw(b'""')) == "fmp4 is empty"


def test_a_jpeg_event_of_832x480_frames_has_no_line_a_stock_client_cannot_read():
    """aiohttp's client reads a line of at most twice its read_bufsize (512 KiB by default):
    each frame of a JPEG event is a line of its own, the whole event far longer."""
    import io

    import aiohttp.helpers
    import numpy as np
    from PIL import Image

    limit = 2 * aiohttp.helpers.DEFAULT_CHUNK_SIZE
    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:480, 0:832]
    frames = []
    for i in range(12):  # a textured, moving picture: about 60-100 KB a frame at quality 80
        picture = np.stack([(x + 8 * i) % 256, (y * 3) % 256, (x ^ y) % 256], -1)
        noisy = (picture + rng.integers(0, 24, picture.shape)).clip(0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(noisy).save(out, format="JPEG", quality=80)
        frames.append(out.getvalue())
    event = jpeg_event(chunk(1), JpegFrames(frames))
    assert len(event) > limit  # one line would break a stock client
    assert max(len(line) for line in event.split(b"\n")) < limit
    assert [base64.b64decode(f) for f in sse_data(event)["frames"]] == frames

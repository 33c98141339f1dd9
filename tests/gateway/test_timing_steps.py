"""The chunk event's ``timing`` says the denoising steps the chunk ran (the quality budget), on
SSE and the WebSocket, in the JPEG and the fMP4 formats alike."""

from __future__ import annotations

import struct

import orjson
import pytest

from services.gateway.chunkview import ChunkView
from services.gateway.formats import StreamFormat
from services.gateway.jpegs import JpegFrames
from services.gateway.sse import fragment_event, jpeg_event
from services.gateway.ws import fragment_message, frames_message
from shared.wire import Chunk, decode, encode


def _chunk(steps: int) -> Chunk:
    return Chunk(
        session_id="s",
        seq=4,
        worker_id="w",
        epoch=1,
        width=4,
        height=2,
        fps=16.0,
        gen_ms=12.0,
        batch=2,
        due_at=10.0,
        done_at=10.1,
        fmp4=b"\x00\x00\x00\x18ftyp",
        fmp4_mime="video/mp4",
        steps=steps,
    )


def _view(steps: int) -> ChunkView:
    return decode("s.chunks", encode(_chunk(steps)), ChunkView)


def _sse(view: ChunkView, fmt: StreamFormat) -> dict:
    if fmt is StreamFormat.FMP4:
        event = fragment_event(view)
    else:
        event = jpeg_event(view, JpegFrames([b"\xff\xd8a"]))
    lines = [line[6:] for line in event.split(b"\n") if line.startswith(b"data: ")]
    return orjson.loads(b"\n".join(lines))["timing"]


def _ws(message: bytes) -> dict:
    (n,) = struct.unpack(">I", message[:4])
    return orjson.loads(message[4 : 4 + n])["timing"]


@pytest.mark.parametrize("steps", [4, 2])
def test_timing_carries_the_chunks_steps_everywhere(steps):
    view = _view(steps)
    timings = [
        _sse(view, StreamFormat.JPEG),
        _sse(view, StreamFormat.FMP4),
        _ws(frames_message(view, JpegFrames([b"\xff\xd8a"]))),
        _ws(fragment_message(view)),
    ]
    assert [t["steps"] for t in timings] == [steps] * 4
    assert all(t["batch"] == 2 for t in timings)


def test_a_chunk_from_a_sender_that_does_not_say_has_steps_0():
    raw = orjson.loads(encode(_chunk(3)))
    del raw["steps"]  # an older worker's message
    view = decode("s.chunks", orjson.dumps(raw), ChunkView)
    assert _sse(view, StreamFormat.JPEG)["steps"] == 0

"""``GET /v1/sessions/{id}/stream``: a session as Server-Sent Events.

Events: ``chunk`` (``id:`` = the chunk's seq, so ``Last-Event-ID`` resumes), ``state`` (a
lifecycle notice: placed, migrated, suspended, resumed, restarted, prompt), ``lag`` (this client
fell behind and skipped to the live edge), ``end`` (the session is over, or this gateway is
shutting down: reconnect elsewhere with ``Last-Event-ID``); ``: keepalive`` comments in between.
A stream without ``Last-Event-ID`` starts at the live edge (the newest chunk); ``?from=start``
asks for what the chunk stream still holds (``bodies.start_of``).

``?format=jpeg`` (default) or ``?format=fmp4`` (:mod:`formats`): a ``chunk`` event's data holds
either ``frames`` (a list of base64 JPEGs, made by this gateway from the chunk's video) or
``fragment`` (the base64 of the chunk's self-contained fragmented MP4, with ``mime``,
``start_s`` and ``duration_s``).

Line lengths: a client reads an event line by line, and a stock one bounds a line (aiohttp's
client: twice its ``read_bufsize``, 512 KiB). A JPEG event puts each frame on a ``data:`` line
of its own (SSE joins the lines of an event with a line feed, which JSON reads as blank), so no
line is longer than one frame (about 80 KiB of base64 for a 832x480 frame of a model's video);
an fMP4 event is one line, at most the chunk's bound (``TURBOSERVE_VIDEO_BITRATE`` over the
chunk's period, base64: 250 KiB at the default).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from services.gateway import bodies, lifetimes
from services.gateway.chunkview import ChunkView
from services.gateway.feeds import End, Entry, Lag, Viewer
from services.gateway.formats import StreamFormat, format_of
from services.gateway.jpegs import JpegFrames, Jpegs
from services.gateway.state import GATEWAY_STATE, authorized_session
from shared.logging import get_logger
from shared.states import SessionState
from shared.wire import SessionNotice

log = get_logger("turboserve.gateway")

GONE_CHECK_S = 1.0
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",  # no proxy buffering in front of us
}


def timing(chunk: ChunkView) -> dict[str, float | int]:
    """How the chunk was made, for the viewer: the same keys on SSE and the WebSocket, in the
    JPEG and the fMP4 formats alike."""
    return {
        "gen_ms": round(chunk.gen_ms, 3),
        "encode_ms": round(chunk.encode_ms, 3),
        "batch": chunk.batch,
        # The denoising steps it ran: fewer than the model's full count under the quality
        # budget (0: a worker that does not say).
        "steps": chunk.steps,
        "due_at": chunk.due_at,
        "done_at": chunk.done_at,
        "latency_ms": round(max(0.0, chunk.done_at - chunk.due_at) * 1000, 3),
        # A video session's: the seq of the last input frame the chunk was made from (output
        # chunk n is made from input chunk n); -1 for a text session.
        "input_seq": chunk.input_seq,
    }


def notice_data(notice: SessionNotice) -> dict[str, object]:
    return {
        "session_id": notice.session_id,
        "kind": str(notice.kind),
        "worker_id": notice.worker_id,
        "epoch": notice.epoch,
        "next_seq": notice.next_seq,
        "detail": notice.detail,
        "at": notice.at,
    }


def jpeg_event(chunk: ChunkView, jpeg: JpegFrames) -> bytes:
    """A chunk's JPEG frames as an SSE event, one frame per ``data:`` line."""
    head = orjson.dumps(
        {
            "session_id": chunk.session_id,
            "seq": chunk.seq,
            "encoding": "jpeg/base64",
            "width": chunk.width,
            "height": chunk.height,
            "fps": chunk.fps,
            "timing": timing(chunk),
            "worker_id": chunk.worker_id,
            # The owner's epoch: a new one is always announced first by an `event: state`
            # (placed, migrated, recovered, restarted).
            "epoch": chunk.epoch,
        }
    )
    frames = b",\ndata: ".join(b'"%s"' % f for f in jpeg.base64)
    return b'event: chunk\nid: %d\ndata: %s,"frames":[\ndata: %s]}\n\n' % (
        chunk.seq,
        head[:-1],
        frames,
    )


def fragment_header(chunk: ChunkView) -> dict[str, object]:
    """What a player needs next to an fMP4 fragment (SSE event and WebSocket header alike)."""
    return {
        "session_id": chunk.session_id,
        "seq": chunk.seq,
        "encoding": "fmp4",
        "mime": chunk.fmp4_mime,
        "width": chunk.width,
        "height": chunk.height,
        "fps": chunk.fps,
        "start_s": chunk.start_s,
        "duration_s": chunk.duration_s,
        "timing": timing(chunk),
        "worker_id": chunk.worker_id,
        "epoch": chunk.epoch,
    }


def fragment_event(chunk: ChunkView) -> bytes:
    # The fragment goes out as the base64 text it came in, as the JPEG frames do.
    head = orjson.dumps({**fragment_header(chunk), "encoding": "fmp4/base64"})
    return b'event: chunk\nid: %d\ndata: %s,"fragment":%s}\n\n' % (
        chunk.seq,
        head[:-1],
        bytes(chunk.fmp4),
    )


async def entry_event(entry: Entry, fmt: StreamFormat, jpegs: Jpegs) -> bytes:
    """The SSE event of a chunk or notice (a chunk's JPEG frames made once, shared by every
    JPEG viewer of the feed)."""
    item = entry.item
    if not isinstance(item, ChunkView):
        return b"event: state\ndata: %s\n\n" % orjson.dumps(notice_data(item))
    if fmt is StreamFormat.FMP4:
        return fragment_event(item)
    if entry.sse is None:
        entry.sse = jpeg_event(item, await entry.jpegs(jpegs))
    return entry.sse


def lag_event(session_id: str, lag: Lag) -> bytes:
    data = {
        "session_id": session_id,
        "skipped": lag.skipped,
        "first_skipped": lag.first_skipped,
        "last_skipped": lag.last_skipped,
    }
    return b"event: lag\ndata: %s\n\n" % orjson.dumps(data)


def end_event(session_id: str, last_seq: int, reason: str) -> bytes:
    data = orjson.dumps({"session_id": session_id, "last_seq": last_seq, "reason": reason})
    return b"event: end\ndata: %s\n\n" % data


async def stream_session(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_STATE]
    record, _ = await authorized_session(gw, request)
    last_seq = bodies.start_of(request, record.last_seq)
    fmt = format_of(request)
    if record.state is SessionState.TERMINATED and record.last_seq <= last_seq:
        return await _ended(request, end_event(record.id, record.last_seq, "closed"))
    if gw.closing.is_set():
        return await _ended(request, end_event(record.id, last_seq, "gateway_shutdown"))
    jpeg = fmt is StreamFormat.JPEG
    async with lifetimes.watching(gw, record.id, last_seq, "sse", jpeg) as viewer:
        try:
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            await resp.write(b"retry: 2000\n\n")
            await _pump(request, resp, record.id, viewer, last_seq, fmt)
        except ConnectionResetError:
            log.info("stream_client_gone", session_id=record.id)
    return resp


async def _ended(request: web.Request, event: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    await resp.write(b"retry: 2000\n\n" + event)
    return resp


async def _pump(
    request: web.Request,
    resp: web.StreamResponse,
    session_id: str,
    viewer: Viewer,
    sent: int,
    fmt: StreamFormat,
) -> None:
    gw = request.app[GATEWAY_STATE]
    keepalive_s = gw.settings.sse_keepalive_s
    quiet_s = 0.0
    while True:
        # Wake at least once a second: a client that went away is noticed (and detached)
        # within that time even when the session sends nothing.
        item = await viewer.next(min(keepalive_s, GONE_CHECK_S))
        if item is None:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("client went away")
            quiet_s += min(keepalive_s, GONE_CHECK_S)
            if quiet_s >= keepalive_s:
                await resp.write(b": keepalive\n\n")
                quiet_s = 0.0
            continue
        quiet_s = 0.0
        if isinstance(item, Entry):
            await resp.write(await entry_event(item, fmt, gw.hub.jpegs))
            if isinstance(item.item, ChunkView):
                sent = item.item.seq
        elif isinstance(item, Lag):
            gw.metrics.lag_skips.labels("sse").inc()
            await resp.write(lag_event(session_id, item))
        elif isinstance(item, End):
            # On a shutdown, what this client has is what it should resume after.
            last = sent if item.reason == "gateway_shutdown" else item.last_seq
            await resp.write(end_event(session_id, last, item.reason))
            return

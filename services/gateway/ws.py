"""``GET /v1/sessions/{id}/ws``: a session over a WebSocket, both ways.

Server to client:

- a **binary** message per chunk: a 4-byte big-endian length ``n``, then ``n`` bytes of JSON
  header ``{"type": "chunk", "session_id", "seq", "encoding": "jpeg", "width", "height", "fps",
  "frame_sizes": [...], "timing": {...}, "worker_id", "epoch"}``, then the frames' JPEG bytes back to
  back (``frame_sizes`` says where each ends; the gateway makes them from the chunk's video);
  With ``?format=fmp4`` (:mod:`formats`; ``jpeg`` is the default) the header is
  ``{"type": "chunk", "session_id", "seq", "encoding": "fmp4", "mime", "width", "height",
  "fps", "start_s", "duration_s", "fragment_size", "timing", "worker_id", "epoch"}`` and the
  bytes after it are the chunk's self-contained fragmented MP4 (init segment + one fragment);
- **text** messages (JSON): ``{"type": "state", ...}`` (a lifecycle notice, as SSE's
  ``event: state``), ``{"type": "lag", ...}``, ``{"type": "end", "last_seq", "reason"}``,
  ``{"type": "ack", "control", "id", "confirmed", "next_seq"}`` (a close's also ``state`` and
  ``last_seq``, its ``next_seq`` null: nothing follows) and ``{"type": "error",
  "control", "id", "error": {"code", "message", ...}}``.

Client to server (text, JSON): ``{"type": "prompt", "prompt": "...", "strength"?: 0.5}``,
``{"type": "pause"}``, ``{"type": "resume"}``, ``{"type": "close"}``, each with an optional
``"id"`` echoed in its answer. A video session's client also sends its camera as **binary**
messages, one input frame each, framed as the chunks are: a 4-byte big-endian length, a JSON
header ``{"type": "frame", "seq", "captured_at"}``, then one JPEG (:mod:`inputs`); a frame it
refuses is answered ``{"type": "error", "control": "frame", "id": seq, "error": ...}``. Controls are handled one at a time, in order, while chunks keep flowing; they mean
exactly what ``POST .../prompt``, ``.../pause``, ``.../resume`` and ``DELETE`` mean
(:mod:`steering`, shared with the WebRTC data channel).

Where it starts: as the SSE stream, at the live edge unless ``last_event_id`` or
``from=start`` says otherwise (``bodies.start_of``).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import WSMsgType, web

from services.gateway import bodies, errors, lifetimes, steering
from services.gateway.auth import authorize_session
from services.gateway.chunkview import ChunkView
from services.gateway.feeds import End, Entry, Lag, Viewer
from services.gateway.formats import StreamFormat, format_of
from services.gateway.inputs import Lane, parse_frame_message, require_video
from services.gateway.jpegs import JpegFrames, Jpegs
from services.gateway.sse import fragment_header, notice_data, timing
from services.gateway.state import GATEWAY_STATE, Gateway, check_rate, load_session
from shared.logging import get_logger
from shared.registry import SessionRecord
from shared.wire import SessionInput

log = get_logger("turboserve.gateway")

HEADER_LEN = struct.Struct(">I")


def frames_message(chunk: ChunkView, jpeg: JpegFrames) -> bytes:
    frames = jpeg.frames
    header = orjson.dumps(
        {
            "type": "chunk",
            "session_id": chunk.session_id,
            "seq": chunk.seq,
            "encoding": "jpeg",
            "width": chunk.width,
            "height": chunk.height,
            "fps": chunk.fps,
            "frame_sizes": [len(f) for f in frames],
            "timing": timing(chunk),
            "worker_id": chunk.worker_id,
            "epoch": chunk.epoch,
        }
    )
    return b"".join([HEADER_LEN.pack(len(header)), header, *frames])


def fragment_message(chunk: ChunkView) -> bytes:
    fragment = chunk.fragment_bytes()
    header = orjson.dumps(
        {"type": "chunk", **fragment_header(chunk), "fragment_size": len(fragment)}
    )
    return b"".join([HEADER_LEN.pack(len(header)), header, fragment])


async def entry_message(entry: Entry, fmt: StreamFormat, jpegs: Jpegs) -> bytes | str:
    """The socket message of a chunk or notice, made once per format for every socket of the
    feed (a chunk's JPEG frames made once, shared with its SSE JPEG viewers)."""
    item = entry.item
    key = str(fmt) if isinstance(item, ChunkView) else "state"  # a notice: one text for all
    message = entry.ws.get(key)
    if message is None:
        if not isinstance(item, ChunkView):
            message = orjson.dumps({"type": "state", **notice_data(item)}).decode()
        elif fmt is StreamFormat.FMP4:
            message = fragment_message(item)
        else:
            message = frames_message(item, await entry.jpegs(jpegs))
        entry.ws[key] = message
    return message


def _text(body: dict[str, Any]) -> str:
    return orjson.dumps(body).decode()


async def session_socket(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_STATE]
    record = await load_session(gw, request.match_info["session_id"])
    operator = authorize_session(gw.keys, request, record)
    if not operator:
        await check_rate(gw, record.owner_key)
    last_seq = bodies.start_of(request, record.last_seq)
    fmt = format_of(request)
    # Room for a frame over the limit to be answered frame_too_large rather than cut off
    # (aiohttp closes the socket, 1009, on a message beyond max_msg_size).
    largest = max(gw.settings.max_body_bytes, 2 * gw.settings.max_frame_bytes)
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=largest)
    if not ws.can_prepare(request).ok:
        raise errors.InvalidRequest(
            "this route takes a WebSocket upgrade (GET with Upgrade: websocket)"
        )
    if gw.closing.is_set():
        raise errors.Unavailable("gateway is shutting down; retry on another replica")
    try:
        jpeg = fmt is StreamFormat.JPEG
        async with (
            lifetimes.watching(gw, record.id, last_seq, "ws", jpeg) as viewer,
            _input_lane(gw, record) as lane,
        ):
            await ws.prepare(request)
            controls: asyncio.Queue[dict[str, Any]] = asyncio.Queue(steering.CONTROLS_IN_FLIGHT)
            # Held while a control is applied and answered: the end of the stream waits for it,
            # so a client that sent "close" gets its ack before the end.
            steering_lock = asyncio.Lock()
            async with asyncio.TaskGroup() as tg:
                sender = tg.create_task(
                    _send(gw, ws, record.id, viewer, last_seq, steering_lock, fmt)
                )
                steering_task = tg.create_task(
                    _steer(gw, ws, record, operator, controls, steering_lock)
                )
                await _receive(gw, ws, record, controls, lane)
                sender.cancel()
                steering_task.cancel()
    finally:
        if not ws.closed:
            with contextlib.suppress(Exception):
                await ws.close()
    return ws


@contextlib.asynccontextmanager
async def _input_lane(gw: Gateway, record: SessionRecord) -> AsyncIterator[Lane | None]:
    """A video session's socket relays its input frames; a text session's has none."""
    if record.input is not SessionInput.VIDEO:
        yield None
        return
    async with gw.inputs.lane(record) as lane:
        yield lane


async def _receive(
    gw: Gateway,
    ws: web.WebSocketResponse,
    record: SessionRecord,
    controls: asyncio.Queue[dict[str, Any]],
    lane: Lane | None,
) -> None:
    """Read the client's messages until it closes; each valid control is queued for _steer,
    each input frame handed to the session's lane. A refused frame is answered with an error
    message (``control`` "frame", ``id`` its seq) and the socket goes on."""
    async for msg in ws:
        if msg.type is WSMsgType.TEXT:
            try:
                body = steering.parse_control(msg.data)
            except steering.ControlRefused as refused:
                await _send_text(ws, refused.message)
                continue
            await controls.put(body)
        elif msg.type is WSMsgType.BINARY:
            seq = None
            try:
                seq, captured_at, image = parse_frame_message(msg.data)
                if lane is None:
                    require_video(record)
                    continue  # not reached: a text session has no lane
                lane.accept(seq, captured_at, image)
            except errors.ApiError as exc:
                gw.metrics.refusals.labels(exc.code).inc()
                await _send_text(ws, steering.error_message("frame", seq, exc))
        else:  # ERROR; CLOSE and CLOSING end the iteration themselves
            break


async def _send_text(ws: web.WebSocketResponse, body: dict[str, Any]) -> None:
    with contextlib.suppress(ConnectionResetError):
        await ws.send_str(_text(body))


async def _steer(
    gw: Gateway,
    ws: web.WebSocketResponse,
    record: SessionRecord,
    operator: bool,
    controls: asyncio.Queue[dict[str, Any]],
    lock: asyncio.Lock,
) -> None:
    while True:
        body = await controls.get()
        async with lock:
            await _send_text(ws, await steering.answer(gw, record, operator, body))


async def _send(
    gw: Gateway,
    ws: web.WebSocketResponse,
    session_id: str,
    viewer: Viewer,
    sent: int,
    steering: asyncio.Lock,
    fmt: StreamFormat,
) -> None:
    keepalive_s = gw.settings.sse_keepalive_s
    try:
        while True:
            item = await viewer.next(keepalive_s)
            if item is None:
                continue  # the WebSocket's own ping/pong keeps the connection alive
            if isinstance(item, Entry):
                message = await entry_message(item, fmt, gw.hub.jpegs)
                if isinstance(message, bytes):
                    await ws.send_bytes(message)
                else:
                    await ws.send_str(message)
                if isinstance(item.item, ChunkView):
                    sent = item.item.seq
            elif isinstance(item, Lag):
                gw.metrics.lag_skips.labels("ws").inc()
                await ws.send_str(
                    _text(
                        {
                            "type": "lag",
                            "session_id": session_id,
                            "skipped": item.skipped,
                            "first_skipped": item.first_skipped,
                            "last_skipped": item.last_skipped,
                        }
                    )
                )
            elif isinstance(item, End):
                last = sent if item.reason == "gateway_shutdown" else item.last_seq
                async with steering:  # the answer to a control in flight goes first
                    pass
                await ws.send_str(
                    _text(
                        {
                            "type": "end",
                            "session_id": session_id,
                            "last_seq": last,
                            "reason": item.reason,
                        }
                    )
                )
                await ws.close(code=1001 if item.reason == "gateway_shutdown" else 1000)
                return
    except ConnectionResetError:
        log.info("socket_client_gone", session_id=session_id)

"""Video sessions' input frames, from the viewer's connection to the worker that owns the session.

A frame comes over the WebSocket (a binary message: a 4-byte big-endian header length, a JSON
header ``{"type": "frame", "seq", "captured_at"}``, then one JPEG; :func:`parse_frame_message`)
or from a WebRTC camera (:mod:`camera`). Each is checked here (a JPEG of at most
``TURBOSERVE_MAX_FRAME_BYTES``, a picture of at most ``MAX_FRAME_PIXELS``, a video session)
and relayed as an ``InputFrame`` on the session's own subject
(``Subjects.session_input``, core NATS): the owner subscribes to it and no one else does, so
the gateway needs no placement lookup and a migration moves the input with the session. The
gateway does not decode or resize the picture; the worker fits it to the model's frame.

Each connection that sends frames has a :class:`Lane`: a small buffer
(``TURBOSERVE_INPUT_BUFFER_FRAMES``) and a task that publishes from it. The task waits while
the NATS client's own outgoing buffer is past :data:`PENDING_BYTES` (a slow or lost link to
NATS); meanwhile the lane drops its oldest frame for each new one and counts it (in each
relayed frame's ``dropped``, and ``turboserve_gateway_input_frames{outcome="dropped"}``). A live
input has no past worth keeping, and a flood costs frames, never memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import orjson

from services.gateway import errors
from services.gateway.metrics import GatewayMetrics
from shared.logging import get_logger
from shared.registry import SessionRecord
from shared.settings import GatewaySettings
from shared.wire import MAX_FRAME_PIXELS, InputFrame, SessionInput, Subjects, encode

log = get_logger("turboserve.gateway")

HEADER_LEN = 4  # bytes of the big-endian header length in front of a frame message's header
MAX_HEADER_BYTES = 1024
# Outgoing bytes the NATS client may hold before a lane waits (4 frames of 1 MiB).
PENDING_BYTES = 4 << 20
PENDING_POLL_S = 0.005


def frame_message(seq: int, captured_at: float, jpeg: bytes) -> bytes:
    """One input frame as a client sends it over the WebSocket."""
    header = orjson.dumps({"type": "frame", "seq": seq, "captured_at": captured_at})
    return len(header).to_bytes(HEADER_LEN, "big") + header + jpeg


def parse_frame_message(data: bytes) -> tuple[int, float, bytes]:
    """``(seq, captured_at, image)`` of a binary WebSocket message; ``InvalidRequest`` when it
    is not one input frame."""
    if len(data) < HEADER_LEN:
        raise errors.InvalidRequest("a binary message is one input frame: too short for one")
    size = int.from_bytes(data[:HEADER_LEN], "big")
    if not 2 <= size <= MAX_HEADER_BYTES or HEADER_LEN + size > len(data):
        raise errors.InvalidRequest(
            f"an input frame's header length must be 2-{MAX_HEADER_BYTES} bytes, within the "
            f"message; got {size}",
            header_bytes=size,
        )
    try:
        header = orjson.loads(data[HEADER_LEN : HEADER_LEN + size])
    except orjson.JSONDecodeError as exc:
        raise errors.InvalidJson(f"an input frame's header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("type") != "frame":
        raise errors.InvalidRequest('an input frame\'s header is {"type": "frame", ...}')
    seq, captured_at = header.get("seq"), header.get("captured_at")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise errors.InvalidRequest("'seq' must be an integer >= 0", field="seq", value=seq)
    if (
        isinstance(captured_at, bool)
        or not isinstance(captured_at, int | float)
        or not math.isfinite(captured_at)
    ):
        raise errors.InvalidRequest(
            "'captured_at' must be a number (unix seconds)", field="captured_at"
        )
    return seq, float(captured_at), data[HEADER_LEN + size :]


def check_image(image: bytes, limit: int) -> None:
    """A JPEG of at most ``limit`` bytes and ``MAX_FRAME_PIXELS``: its header is read, not its
    pixels. Raises ``FrameTooLarge`` or ``InvalidFrame``."""
    from PIL import Image, UnidentifiedImageError

    if len(image) > limit:
        raise errors.FrameTooLarge(
            f"a frame of {len(image)} bytes is over the limit of {limit}",
            bytes=len(image),
            limit=limit,
        )
    if not image.startswith(b"\xff\xd8\xff"):
        raise errors.InvalidFrame("a frame must be one JPEG image (no JPEG start marker)")
    try:
        with Image.open(io.BytesIO(image)) as picture:
            width, height = picture.size
            fmt = picture.format
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise errors.InvalidFrame(f"a frame must be one JPEG image: {exc}") from None
    if fmt != "JPEG":
        raise errors.InvalidFrame(f"a frame must be one JPEG image, not {fmt}")
    if width * height > MAX_FRAME_PIXELS:
        raise errors.FrameTooLarge(
            f"a {width}x{height} frame is over {MAX_FRAME_PIXELS} pixels",
            width=width,
            height=height,
            limit_pixels=MAX_FRAME_PIXELS,
        )


def require_video(record: SessionRecord) -> None:
    if record.input is not SessionInput.VIDEO:
        raise errors.NotVideoSession(
            f"session {record.id} generates from text: it takes no input frames "
            '(create it with "input": "video")',
            session_id=record.id,
        )


class Lane:
    """One connection's frames for one video session (module docstring)."""

    def __init__(self, relay: InputRelay, session_id: str) -> None:
        self.relay = relay
        self.session_id = session_id
        self.subject = relay.subjects.session_input(session_id)
        self.frames: deque[tuple[int, float, float, bytes]] = deque()
        self.ready = asyncio.Event()
        self.dropped = 0
        self.relayed = 0
        self.task: asyncio.Task[None] | None = None

    def accept(self, seq: int, captured_at: float, image: bytes) -> None:
        """Checks ``image`` and queues it; raises the frame's ``ApiError``."""
        settings, metrics = self.relay.settings, self.relay.metrics
        try:
            check_image(image, settings.max_frame_bytes)
        except errors.ApiError:
            metrics.input_frames.labels("refused").inc()
            raise
        if len(self.frames) >= settings.input_buffer_frames:
            self.frames.popleft()
            self.dropped += 1
            metrics.input_frames.labels("dropped").inc()
        self.frames.append((seq, captured_at, time.time(), image))
        self.ready.set()

    async def run(self) -> None:
        nc = self.relay.nc
        while True:
            await self.ready.wait()
            self.ready.clear()
            while self.frames:
                # nats-py signals no drain of its buffer: it is polled
                while _pending_bytes(nc) > PENDING_BYTES:  # noqa: ASYNC110
                    await asyncio.sleep(PENDING_POLL_S)
                if not self.frames:
                    break
                seq, captured_at, received_at, image = self.frames.popleft()
                frame = InputFrame(
                    session_id=self.session_id,
                    seq=seq,
                    captured_at=captured_at,
                    received_at=received_at,
                    image=image,
                    dropped=self.dropped,
                )
                try:
                    await nc.publish(self.subject, encode(frame))
                except Exception as exc:  # noqa: BLE001 - NATS away: the frame is lost, counted
                    self.dropped += 1
                    self.relay.metrics.input_frames.labels("dropped").inc()
                    log.info("input_frame_unpublished", session_id=self.session_id, error=str(exc))
                    continue
                self.relayed += 1
                self.relay.metrics.input_frames.labels("relayed").inc()


def _pending_bytes(nc: Any) -> int:
    return int(getattr(nc, "pending_data_size", 0) or 0)


class InputRelay:
    """This gateway's input lanes (module docstring)."""

    def __init__(
        self, nc: Any, subjects: Subjects, settings: GatewaySettings, metrics: GatewayMetrics
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.settings = settings
        self.metrics = metrics
        self.lanes: set[Lane] = set()

    def open(self, record: SessionRecord) -> Lane:
        """A lane for one connection's frames of ``record`` (a video session: else
        ``NotVideoSession``); :meth:`close` it when the connection ends."""
        require_video(record)
        lane = Lane(self, record.id)
        lane.task = asyncio.create_task(lane.run(), name=f"input-{record.id}")
        self.lanes.add(lane)
        return lane

    async def close(self, lane: Lane) -> None:
        """Ends a lane: what it holds is published first, for at most a second."""
        self.lanes.discard(lane)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                while lane.frames:  # noqa: ASYNC110 - the lane's task empties it
                    await asyncio.sleep(0.01)
        if lane.task is not None:
            lane.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lane.task

    @contextlib.asynccontextmanager
    async def lane(self, record: SessionRecord) -> AsyncIterator[Lane]:
        """:meth:`open`, then :meth:`close` at the end of the block."""
        lane = self.open(record)
        try:
            yield lane
        finally:
            await self.close(lane)

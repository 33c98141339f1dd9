"""Video sessions' input frames, from NATS into the engine's input buffers.

The gateway relays each frame a viewer sends on the session's own subject
(``Subjects.session_input``, core NATS). The worker subscribes to that subject for each video
session its engine holds, and to no other, so a frame crosses the network once, to its owner.
The set of subscriptions follows the engine: a session assigned, adopted or recovered here is
subscribed within ``RECONCILE_S``; one that left (stopped, migrated away, fenced) is
unsubscribed. A frame that arrives in between (a migration's handoff) is lost, and the session
takes the next frames: a live input has no past worth waiting for.

Each frame is decoded and resized to the model's resolution here (``input_frames``, off the
event loop in a thread) and put in the session's buffer, where the generation thread takes an
input chunk at the start of each chunk. A subscription delivers its messages one at a time, so
a session's frames reach its buffer in order. Its pending queue is bounded (NATS drops what a
slow subscriber leaves beyond it), like the buffer itself (which drops the oldest frame): a
flood costs frames, never memory. A malformed message or an image that does not decode is
logged and dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from services.gpu_worker.input_frames import FrameRefused, InputBuffer, decode_frame
from shared.logging import get_logger
from shared.wire import InputFrame, Subjects, decode_or_drop

log = get_logger("turboserve.worker.input")

RECONCILE_S = 0.1  # how often the subscriptions are matched to the engine's video sessions
PENDING_FRAMES = 32  # frames a subscription holds before NATS drops (a slow decoder)


class InputFeed:
    """The input subscriptions of one worker (the event loop's side of the engine's input
    buffers, which are thread-safe)."""

    def __init__(
        self,
        nc: Any,
        subjects: Subjects,
        video_sessions: Callable[[], list[str]],
        buffer_of: Callable[[str], InputBuffer | None],
        resolution: tuple[int, int],
        on_frame: Callable[[], None],
        count: Callable[[str], None] | None = None,
    ) -> None:
        """``video_sessions`` and ``buffer_of``: the engine's (thread-safe); ``resolution``:
        the model's (height, width); ``on_frame``: called after each frame is put (wakes the
        generation loop); ``count``: called with each frame's outcome (``put``, ``stale``,
        ``refused``, ``malformed``, ``unknown_session``, and ``dropped_at_gateway`` for each
        frame the gateway's relay dropped, from ``InputFrame.dropped``), for metrics."""
        self.nc = nc
        self.subjects = subjects
        self.video_sessions = video_sessions
        self.buffer_of = buffer_of
        self.height, self.width = resolution
        self.on_frame = on_frame
        self.count = count or (lambda _outcome: None)
        self._subs: dict[str, Any] = {}
        self._gateway_dropped: dict[str, int] = {}  # the last InputFrame.dropped per session

    @property
    def subscribed(self) -> list[str]:
        return sorted(self._subs)

    async def run_forever(self) -> None:
        while True:
            await self.reconcile()
            await asyncio.sleep(RECONCILE_S)

    async def reconcile(self) -> None:
        """Subscribe to each video session's input that the engine now holds; unsubscribe
        from the ones it no longer holds."""
        wanted = set(self.video_sessions())
        for sid in sorted(wanted.difference(self._subs)):
            self._subs[sid] = await self.nc.subscribe(
                self.subjects.session_input(sid),
                cb=self._on_message,
                pending_msgs_limit=PENDING_FRAMES,
            )
        for sid in sorted(set(self._subs).difference(wanted)):
            sub = self._subs.pop(sid)
            self._gateway_dropped.pop(sid, None)
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - a connection gone: nothing to undo
                log.info("input_unsubscribe_failed", session_id=sid, error=str(exc))

    async def close(self) -> None:
        for sid in list(self._subs):
            sub = self._subs.pop(sid)
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001, S110 - closing: the connection may be gone
                pass

    async def _on_message(self, msg: Any) -> None:
        frame = decode_or_drop(msg.subject, msg.data, InputFrame, log)
        if frame is None:
            self.count("malformed")
            return
        if msg.subject != self.subjects.session_input(frame.session_id):
            log.warning(
                "input_frame_misaddressed", subject=msg.subject, session_id=frame.session_id
            )
            self.count("malformed")
            return
        await self.take(frame)

    async def take(self, frame: InputFrame) -> bool:
        """Decode ``frame`` and put it in its session's buffer; True when put."""
        buffer = self.buffer_of(frame.session_id)
        if buffer is None:  # left between the message and now
            self.count("unknown_session")
            return False
        # The gateway's drops so far (a total per connection): what is new since the last frame.
        for _ in range(max(0, frame.dropped - self._gateway_dropped.get(frame.session_id, 0))):
            self.count("dropped_at_gateway")
        self._gateway_dropped[frame.session_id] = frame.dropped
        try:
            pixels = await asyncio.to_thread(decode_frame, frame.image, self.height, self.width)
        except FrameRefused as exc:
            log.warning(
                "input_frame_refused", session_id=frame.session_id, seq=frame.seq, code=exc.code
            )
            self.count("refused")
            return False
        if not buffer.put(frame.seq, pixels, frame.captured_at):
            self.count("stale")
            return False
        self.count("put")
        self.on_frame()
        return True

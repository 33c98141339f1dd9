"""How the gateway reads a session's chunk subject: :class:`shared.wire.Chunk` with its frames
left as the JSON text they arrived in.

The gateway relays frames without looking at them, and SSE sends them as the same base64 text
the wire carries, so decoding them to bytes and encoding them back would be wasted work (most of
what a chunk costs the gateway). :class:`ChunkView` is a decode-only view of the wire's
``Chunk``, not a second message: a test keeps its fields the wire's, and the WebSocket, which
sends raw bytes, decodes the frames once per chunk.
"""

from __future__ import annotations

import msgspec

from shared.wire import PROTOCOL_VERSION, Id, SessionNotice, StreamEnd

_FRAMES = msgspec.json.Decoder(list[bytes])


class ChunkView(msgspec.Struct, tag="chunk", kw_only=True, forbid_unknown_fields=False):
    v: int = PROTOCOL_VERSION
    session_id: Id
    seq: int
    worker_id: Id
    epoch: int
    encoding: str
    frames: msgspec.Raw  # ["<base64>", ...] as it came
    width: int
    height: int
    fps: float
    gen_ms: float
    batch: int
    due_at: float
    done_at: float

    def frame_bytes(self) -> list[bytes]:
        return _FRAMES.decode(self.frames)


# What the chunk subject carries, as the gateway reads it (the wire's ChunkStreamMsg).
FeedMsg = ChunkView | StreamEnd | SessionNotice

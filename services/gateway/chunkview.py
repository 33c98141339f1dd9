"""How the gateway reads a session's chunk subject: :class:`shared.wire.Chunk` with its fMP4
fragment left as the JSON text it arrived in.

SSE sends the fragment as the same base64 text the wire carries, so the gateway checks it
(:func:`fragment_fault`) and splices it into the event rather than decoding it to bytes and
encoding it back (about a third of what a chunk costs the gateway). :class:`ChunkView` is a
decode-only view of the wire's ``Chunk``, not a second message: a test keeps its fields the
wire's, and the WebSocket, which sends raw bytes, and the JPEG maker decode the fragment once
per chunk.
"""

from __future__ import annotations

import msgspec

from shared.wire import PROTOCOL_VERSION, Id, SessionNotice, StreamEnd

_FRAGMENT = msgspec.json.Decoder(bytes)
NO_FRAGMENT = b'""'  # an empty ``fmp4``: no video, a chunk no viewer can show


class ChunkView(msgspec.Struct, tag="chunk", kw_only=True, forbid_unknown_fields=False):
    v: int = PROTOCOL_VERSION
    session_id: Id
    seq: int
    worker_id: Id
    epoch: int
    width: int
    height: int
    fps: float
    gen_ms: float
    batch: int
    due_at: float
    done_at: float
    fmp4: msgspec.Raw  # "<base64>" as it came
    fmp4_mime: str = ""
    start_s: float = 0.0
    duration_s: float = 0.0
    encode_ms: float = 0.0
    steps: int = 0
    input_seq: int = -1

    def fragment_bytes(self) -> bytes:
        return _FRAGMENT.decode(self.fmp4)


def fragment_fault(fragment: msgspec.Raw) -> str | None:
    """What is wrong with a chunk's fragment as the gateway relays it, or None: it must be one
    non-empty base64 JSON string (as the wire's ``Chunk`` says), on one line, since SSE sends
    it verbatim and a line break would end the event."""
    raw = bytes(fragment)
    if b"\n" in raw or b"\r" in raw:
        return "fmp4 holds a line break"
    if raw == NO_FRAGMENT:
        return "fmp4 is empty"
    try:
        _FRAGMENT.decode(raw)
    except msgspec.ValidationError as exc:
        return f"fmp4: {exc}"
    return None


# What the chunk subject carries, as the gateway reads it (the wire's ChunkStreamMsg).
FeedMsg = ChunkView | StreamEnd | SessionNotice

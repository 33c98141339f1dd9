"""How the gateway reads a session's chunk subject: :class:`shared.wire.Chunk` with its frames
left as the JSON text they arrived in.

SSE sends frames (and the fMP4 fragment) as the same base64 text the wire carries, so the gateway checks them
(:func:`frames_fault`) and splices them into the event rather than decoding them to bytes and
encoding them back (about a third of what a chunk costs the gateway). :class:`ChunkView` is a
decode-only view of the wire's ``Chunk``, not a second message: a test keeps its fields the
wire's, and the WebSocket, which sends raw bytes, decodes the frames once per chunk.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.wire import PROTOCOL_VERSION, Id, SessionNotice, StreamEnd

_FRAMES = msgspec.json.Decoder(list[bytes])
_FRAGMENT = msgspec.json.Decoder(bytes)
NO_FRAGMENT = b'""'  # the wire's empty ``fmp4``: the worker made no fragment


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
    fmp4: msgspec.Raw = msgspec.Raw(NO_FRAGMENT)  # "<base64>" as it came
    fmp4_mime: str = ""
    start_s: float = 0.0
    duration_s: float = 0.0
    encode_ms: float = 0.0
    steps: int = 0

    def frame_bytes(self) -> list[bytes]:
        return _FRAMES.decode(self.frames)

    @property
    def has_fragment(self) -> bool:
        return bytes(self.fmp4) != NO_FRAGMENT

    def fragment_bytes(self) -> bytes:
        return _FRAGMENT.decode(self.fmp4)


def frames_fault(frames: msgspec.Raw) -> str | None:
    """What is wrong with a chunk's frames as the gateway relays them, or None: they must be a
    JSON list of base64 strings (as the wire's ``Chunk`` says), in the compact form every
    encoder writes, since SSE sends them verbatim and a line break would end the event."""
    return _relay_fault(frames, _FRAMES, "frames", "hold")


def fragment_fault(fragment: msgspec.Raw) -> str | None:
    """As :func:`frames_fault`, for the fMP4 fragment: one base64 JSON string, on one line."""
    return _relay_fault(fragment, _FRAGMENT, "fmp4", "holds")


def _relay_fault(
    value: msgspec.Raw, decoder: msgspec.json.Decoder[Any], what: str, verb: str
) -> str | None:
    raw = bytes(value)
    if b"\n" in raw or b"\r" in raw:
        return f"{what} {verb} a line break"
    try:
        decoder.decode(raw)
    except msgspec.ValidationError as exc:
        return f"{what}: {exc}"
    return None


# What the chunk subject carries, as the gateway reads it (the wire's ChunkStreamMsg).
FeedMsg = ChunkView | StreamEnd | SessionNotice

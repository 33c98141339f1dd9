"""Which encoding a stream sends, as the client asks with ``?format=`` on ``.../stream`` and
``.../ws``.

- ``jpeg`` (the default for API clients): one JPEG per frame; simple clients draw them as
  they come, with no video decoder. The gateway makes them from the chunk's H.264 (decoded
  once per chunk for all of the session's JPEG viewers on this gateway, and only while it has
  one): CPU on the gateway, and about five times the bytes of ``fmp4`` to each viewer
  (docs/results.md).
- ``fmp4``: the chunk as the worker encoded it once, a self-contained fragmented MP4 (H.264,
  keyframe first: init segment + one fragment), for Media Source Extensions or any decoder;
  relayed as it came, at no CPU cost to the gateway.

What crosses NATS is the fragment alone, whatever the viewers take.
"""

from __future__ import annotations

import enum

from aiohttp import web

from services.gateway import errors


class StreamFormat(enum.StrEnum):
    JPEG = "jpeg"
    FMP4 = "fmp4"


DEFAULT_FORMAT = StreamFormat.JPEG
STREAM_FORMATS = tuple(str(f) for f in StreamFormat)


def format_of(request: web.Request) -> StreamFormat:
    raw = request.query.get("format", str(DEFAULT_FORMAT))
    try:
        return StreamFormat(raw)
    except ValueError:
        raise errors.InvalidRequest(
            f"'format' must be one of {', '.join(STREAM_FORMATS)}",
            field="format",
            value=raw,
            allowed=list(STREAM_FORMATS),
        ) from None

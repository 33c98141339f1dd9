"""Which encoding a stream sends, as the client asks with ``?format=`` on ``.../stream`` and
``.../ws``.

- ``jpeg`` (the default for API clients): one JPEG per frame, as always; simple clients draw
  them as they come.
- ``fmp4``: the chunk as the worker encoded it once, a self-contained fragmented MP4 (H.264,
  keyframe first: init segment + one fragment), for Media Source Extensions or any decoder.

The gateway never encodes: both forms come from the worker in the same wire ``Chunk``. A chunk
that carries no fragment (a worker that made none) goes out as ``jpeg`` even on an ``fmp4``
stream; its ``encoding`` says so.
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

"""The one SSE reader of the tools and benches: bytes in, events out, no I/O.

Each caller keeps its transport (aiohttp's body for the replay and the pacing bench; a bare
``asyncio.Protocol`` for the gateway bench, whose latency must be the gateway's, not an HTTP
library's) and feeds what arrives to :class:`SseParser`, which reads the event stream format:
lines ending in LF, CRLF or CR, ``field: value`` with one optional space after the colon,
``:`` comments, data lines joined with LF, an event complete at a blank line.

Unlike a browser, a block with only ``retry:`` (the gateway's first write: the viewer is
attached) comes out as an event too, with ``retry_ms`` set and no data: the benches time it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str = "message"
    data: bytes = b""
    id: str | None = None
    retry_ms: int | None = None


class SseParser:
    """Feed it bytes as they arrive; it returns the events they complete."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._reset()

    def _reset(self) -> None:
        self._event = ""
        self._data: list[bytes] = []
        self._id: str | None = None
        self._retry: int | None = None
        self._seen = False

    def feed(self, data: bytes) -> list[SseEvent]:
        self._buf += data
        events: list[SseEvent] = []
        while True:
            eol = self._eol()
            if eol is None:
                return events
            end, after = eol
            line = bytes(self._buf[:end])
            del self._buf[:after]
            event = self._line(line)
            if event is not None:
                events.append(event)

    def _eol(self) -> tuple[int, int] | None:
        """Where the first complete line ends, and where the next begins."""
        lf, cr = self._buf.find(b"\n"), self._buf.find(b"\r")
        if cr < 0 or 0 <= lf < cr:
            return None if lf < 0 else (lf, lf + 1)
        if cr + 1 == len(self._buf):
            return None  # a CR last: an LF may follow in the next bytes
        return (cr, cr + 2) if self._buf[cr + 1] == 0x0A else (cr, cr + 1)

    def _line(self, line: bytes) -> SseEvent | None:
        if not line:
            if not self._seen:
                return None
            event = SseEvent(
                self._event or "message", b"\n".join(self._data), self._id, self._retry
            )
            self._reset()
            return event
        if line.startswith(b":"):
            return None
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        self._seen = True
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value.decode()
        elif name == b"id":
            self._id = value.decode()
        elif name == b"retry" and value.isdigit():
            self._retry = int(value)
        return None


async def read_events(body: AsyncIterable[bytes]) -> AsyncIterator[SseEvent]:
    """The events of an SSE body read in any pieces (aiohttp's ``resp.content``)."""
    parser = SseParser()
    async for data in body:
        for event in parser.feed(data):
            yield event

"""The tools' one SSE reader: the event stream format, however the bytes are split."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.sse import end_event
from tools.sse import SseEvent, SseParser

STREAM = (
    b"retry: 2000\n\n"
    b": a comment\n"
    b'event: chunk\nid: 7\ndata: {"a":\ndata: 1}\n\n'
    b"event: lag\r\ndata:{}\r\n\r\n"
    b"data: plain\r\rdata: orphan"
)
EVENTS = [
    SseEvent("message", b"", None, 2000),
    SseEvent("chunk", b'{"a":\n1}', "7"),
    SseEvent("lag", b"{}"),
    SseEvent("message", b"plain"),
]


def test_fields_comments_line_ends_and_an_unfinished_event() -> None:
    assert SseParser().feed(STREAM) == EVENTS


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    parser, events, at = SseParser(), [], 0
    for cut in sorted(cuts):
        events += parser.feed(STREAM[at:cut])
        at = cut
    events += parser.feed(STREAM[at:])
    assert events == EVENTS


def test_the_gateways_own_end_event() -> None:
    (attached, end) = SseParser().feed(b"retry: 2000\n\n" + end_event("s-1", 41, "deleted"))
    assert attached.retry_ms == 2000
    assert end.event == "end" and orjson.loads(end.data)["last_seq"] == 41

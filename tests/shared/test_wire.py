import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import wire
from shared.wire import (
    Chunk,
    ChunkStreamMsg,
    Heartbeat,
    ProvisionerCmdKind,
    ProvisionerCommand,
    ProvisionerEvent,
    SessionEvent,
    SessionEventKind,
    StreamEnd,
    Subjects,
    WireError,
    WorkerCmdKind,
    WorkerCommand,
    WorkerStatus,
    decode,
    encode,
)

ids = st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True)

SAMPLES = [
    SessionEvent(session_id="s1", kind=SessionEventKind.CREATED, prompt="a fox", seed=3),
    WorkerCommand(
        kind=WorkerCmdKind.ASSIGN, worker_id="w1", epoch=4, session_id="s1", prompt="p", seq=7
    ),
    Heartbeat(
        worker_id="w1",
        status=WorkerStatus.READY,
        capacity=8,
        active=2,
        sessions=["a", "b"],
        chunk_ms={1: 10.5, 4: 22.0},
        mem_free_bytes=123,
    ),
    Chunk(
        session_id="s1",
        seq=3,
        worker_id="w1",
        epoch=2,
        width=64,
        height=48,
        fps=16.0,
        gen_ms=12.5,
        batch=3,
        due_at=1.0,
        done_at=1.5,
        fmp4=b"\x00\x00\x00\x18ftypisom",
    ),
    StreamEnd(session_id="s1", last_seq=9),
    ProvisionerCommand(kind=ProvisionerCmdKind.START, count=2, worker_ids=["w-1"]),
    ProvisionerEvent(worker_id="w-1", status=WorkerStatus.BOOTING, detail="pid 5"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert decode("x", data, type(msg)) == msg
    assert decode("x", data, wire.Message) == msg


def test_union_decoding_picks_the_tagged_type():
    end = decode(
        "ts.session.s.chunks", encode(StreamEnd(session_id="s", last_seq=1)), ChunkStreamMsg
    )
    assert isinstance(end, StreamEnd)


@given(
    session_id=ids,
    seq=st.integers(min_value=0, max_value=2**40),
    fmp4=st.binary(max_size=256),
)
def test_chunk_round_trip_property(session_id, seq, fmp4):
    chunk = Chunk(
        session_id=session_id,
        seq=seq,
        worker_id="w",
        epoch=1,
        width=1,
        height=1,
        fps=16.0,
        gen_ms=0.0,
        batch=1,
        due_at=0.0,
        done_at=0.0,
        fmp4=fmp4,
    )
    assert decode("s", encode(chunk), Chunk) == chunk


@pytest.mark.parametrize(
    ("data", "fault_part"),
    [
        (b"not json", "malformed"),
        (b"{}", "session_id"),
        (b'{"type": "session_event", "kind": "created"}', "session_id"),
        (b'{"type": "session_event", "session_id": "a b", "kind": "created"}', "session_id"),
        (b'{"type": "session_event", "session_id": "s", "kind": "explode"}', "kind"),
        (b'{"type": "session_event", "session_id": "s", "kind": "created", "v": 99}', "version"),
        (b'{"type": "chunk", "session_id": "s"}', ""),
    ],
)
def test_bad_messages_raise_wire_error_naming_subject(data, fault_part):
    with pytest.raises(WireError) as info:
        decode("ts.session.events", data, SessionEvent)
    assert info.value.subject == "ts.session.events"
    assert "ts.session.events" in str(info.value)
    assert fault_part.lower() in info.value.fault.lower()


@given(st.binary(max_size=200))
def test_garbage_never_raises_anything_but_wire_error(data):
    try:
        decode("s", data, wire.Message)
    except WireError:
        pass


def test_subjects_use_prefix():
    s = Subjects("acme")
    assert s.session_events == "acme.session.events"
    assert s.chunks("abc") == "acme.session.abc.chunks"
    assert s.worker_cmd("w1") == "acme.worker.w1.cmd"
    assert s.chunks_stream == "acme_CHUNKS" and s.sessions_stream == "acme_SESSIONS"
    assert Subjects().prefix == "ts"


def test_distinct_prefixes_never_share_a_stream():
    prefixes = ["ts", "TS", "a_b", "a-b", "ts_SESSIONS", "x_CHUNKS"]
    names = [n for p in prefixes for n in (Subjects(p).sessions_stream, Subjects(p).chunks_stream)]
    assert len(set(names)) == len(names)


def test_provisioner_count_is_bounded():
    with pytest.raises(WireError, match="count"):
        decode(
            "p",
            b'{"type":"provisioner_cmd","kind":"start","count":1000000000000}',
            ProvisionerCommand,
        )


@pytest.mark.parametrize("bad", ["", "a b", "a.*", "a.>", "a..b", "a.b", "a/b", "x" * 33])
def test_bad_prefix_rejected(bad):
    with pytest.raises(ValueError, match="prefix"):
        Subjects(bad)


def test_every_message_has_version_field():
    for msg in SAMPLES:
        assert msg.v == wire.PROTOCOL_VERSION
        assert b'"v":%d' % wire.PROTOCOL_VERSION in encode(msg)


def test_messages_are_structs():
    assert all(isinstance(m, msgspec.Struct) for m in SAMPLES)


def test_decode_or_drop_logs_and_returns_none():
    logged = []

    class Log:
        def warning(self, event, **kw):
            logged.append((event, kw))

    assert wire.decode_or_drop("ts.x", b"junk", SessionEvent, Log()) is None
    assert logged and logged[0][0] == "bad_message_dropped" and logged[0][1]["subject"] == "ts.x"
    ok = SessionEvent(session_id="s", kind=SessionEventKind.IDLE)
    assert wire.decode_or_drop("ts.x", encode(ok), SessionEvent, Log()) == ok
    assert len(logged) == 1

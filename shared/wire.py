"""The wire contract: every NATS subject and every message the services exchange.

One module, so that a change to the protocol is one diff. Messages are msgspec ``Struct``s
encoded as JSON (readable with ``nats sub``; bytes fields travel base64-encoded). Every message
carries ``v``, the protocol version; a receiver rejects versions it does not know.

Decoding never raises anything but :class:`WireError`, which names the subject and the fault,
so a service can log and drop a bad message in one ``except`` clause.
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, TypeVar

import msgspec

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "ts"


class WireError(ValueError):
    """A message that cannot be decoded; names the subject and what was wrong with it."""

    retryable = False

    def __init__(self, subject: str, fault: str) -> None:
        super().__init__(f"bad message on {subject!r}: {fault}")
        self.subject = subject
        self.fault = fault


# --------------------------------------------------------------------------------------------
# Subjects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject names under one configurable prefix (``TURBOSERVE_SUBJECT_PREFIX``).

    Session events and chunks go through JetStream streams (durable, replayable); worker
    commands, heartbeats and provisioner traffic are plain core-NATS subjects.
    """

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        # One token of a strict alphabet: it is also the start of the stream names, which must be
        # valid and distinct for distinct prefixes (so deployments never share a stream).
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", self.prefix):
            raise ValueError(f"invalid subject prefix {self.prefix!r}: 1-32 characters of [A-Za-z0-9_-]")

    # Gateway -> scheduler (JetStream stream ``sessions_stream``).
    @property
    def session_events(self) -> str:
        return f"{self.prefix}.session.events"

    # Worker -> gateways (JetStream stream ``chunks_stream``, short retention, replay by seq).
    def chunks(self, session_id: str) -> str:
        return f"{self.prefix}.session.{session_id}.chunks"

    @property
    def chunks_wildcard(self) -> str:
        return f"{self.prefix}.session.*.chunks"

    # Scheduler -> one worker.
    def worker_cmd(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.cmd"

    @property
    def worker_heartbeat(self) -> str:
        return f"{self.prefix}.worker.heartbeat"

    @property
    def provisioner_cmd(self) -> str:
        return f"{self.prefix}.provisioner.cmd"

    @property
    def provisioner_events(self) -> str:
        return f"{self.prefix}.provisioner.events"

    @property
    def sessions_stream(self) -> str:
        return f"{self.prefix}_SESSIONS"

    @property
    def chunks_stream(self) -> str:
        return f"{self.prefix}_CHUNKS"


def valid_id(value: str) -> bool:
    """Whether ``value`` is a valid session or worker id (it becomes a subject token)."""
    return _ID_RE.fullmatch(value) is not None


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


class SessionEventKind(enum.StrEnum):
    CREATED = "created"
    PROMPT = "prompt"  # the prompt changed; takes effect at the next chunk boundary
    ACTIVE = "active"
    IDLE = "idle"
    CLOSED = "closed"


class WorkerCmdKind(enum.StrEnum):
    ASSIGN = "assign"  # start generating a new session (or continue one at ``seq``)
    STOP = "stop"  # the session is over: free its slot
    SUSPEND = "suspend"  # state to host memory
    RESUME = "resume"  # state back to the device
    PROMPT = "prompt"  # new prompt at the next chunk boundary
    DRAIN = "drain"  # take no new sessions


class WorkerStatus(enum.StrEnum):
    BOOTING = "booting"
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"


class ProvisionerCmdKind(enum.StrEnum):
    START = "start"
    STOP = "stop"


# Session and worker ids become subject tokens: a strict alphabet keeps them safe there.
MAX_WORKERS_PER_COMMAND = 1024
ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]


class _Msg(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    v: int = PROTOCOL_VERSION


class SessionEvent(_Msg, tag="session_event"):
    session_id: Id
    kind: SessionEventKind
    at: float = msgspec.field(default_factory=time.time)
    prompt: str | None = None
    seed: int | None = None


class WorkerCommand(_Msg, tag="worker_cmd"):
    kind: WorkerCmdKind
    worker_id: Id
    # Fencing: a worker acts only if ``epoch`` matches the registry's epoch for the session.
    epoch: int = 0
    session_id: Id | None = None
    prompt: str | None = None
    seed: int | None = None
    # First seq to generate (a continued session never repeats or skips a seq).
    seq: int = 0


class Heartbeat(_Msg, tag="heartbeat"):
    worker_id: Id
    status: WorkerStatus
    capacity: int
    active: int
    sessions: list[str] = msgspec.field(default_factory=list)
    device: str = "cpu"
    # Measured chunk generation time per batch size (ms), from this worker's recent steps.
    chunk_ms: dict[int, float] = msgspec.field(default_factory=dict)
    mem_free_bytes: int | None = None
    mem_total_bytes: int | None = None
    at: float = msgspec.field(default_factory=time.time)


class Chunk(_Msg, tag="chunk"):
    session_id: Id
    seq: int
    worker_id: Id
    epoch: int
    encoding: str  # e.g. "jpeg": each entry of ``frames`` is one JPEG image
    frames: list[bytes]
    width: int
    height: int
    fps: float
    gen_ms: float  # wall time of the batched step that produced this chunk
    batch: int  # sessions in that step
    due_at: float  # when the chunk was due (wall clock, seconds)
    done_at: float  # when it was generated


class StreamEnd(_Msg, tag="stream_end"):
    session_id: Id
    last_seq: int  # -1 when no chunk was produced
    reason: str = "closed"


class ProvisionerCommand(_Msg, tag="provisioner_cmd"):
    kind: ProvisionerCmdKind
    count: Annotated[int, msgspec.Meta(ge=0, le=MAX_WORKERS_PER_COMMAND)] = 1
    worker_ids: list[Id] = msgspec.field(default_factory=list)
    gpu_kind: str | None = None


class ProvisionerEvent(_Msg, tag="provisioner_event"):
    worker_id: Id
    status: WorkerStatus
    detail: str = ""
    at: float = msgspec.field(default_factory=time.time)


_ID_RE = re.compile(ID_PATTERN)

ChunkStreamMsg = Chunk | StreamEnd
Message = SessionEvent | WorkerCommand | Heartbeat | Chunk | StreamEnd | ProvisionerCommand | ProvisionerEvent

M = TypeVar("M")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(subject: str, data: bytes, type_: type[M]) -> M:
    """Decode ``data`` received on ``subject`` as ``type_`` (a Struct or a union of them).

    Raises :class:`WireError` for anything that is not a valid message of that type in a
    protocol version this code speaks.
    """
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        msg = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(subject, str(exc)) from None
    if msg.v != PROTOCOL_VERSION:
        raise WireError(subject, f"protocol version {msg.v} unsupported (speaks {PROTOCOL_VERSION})")
    return msg


class _Log(Protocol):
    def warning(self, event: str, /, **kw: Any) -> Any: ...


def decode_or_drop(subject: str, data: bytes, type_: type[M], log: _Log) -> M | None:
    """Decode, or log the bad message with its subject and fault and return None, so that the
    caller drops it. Every subscription uses this: no input ever kills a service."""
    try:
        return decode(subject, data, type_)
    except WireError as exc:
        log.warning("bad_message_dropped", subject=exc.subject, fault=exc.fault)
        return None

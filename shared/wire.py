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
from typing import Annotated, Any, Protocol, TypeVar, cast

import msgspec

# 2: a chunk is its H.264 fragment alone (the per-frame JPEG list and its ``encoding`` left the
# wire; a gateway makes JPEG for the viewers that ask for it).
PROTOCOL_VERSION = 2
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
            raise ValueError(
                f"invalid subject prefix {self.prefix!r}: 1-32 characters of [A-Za-z0-9_-]"
            )

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

    # Gateway -> the worker that owns the session: a video-to-video session's input frames
    # (core NATS, no stream: a frame that finds no subscriber is late already).
    def session_input(self, session_id: str) -> str:
        return f"{self.prefix}.session.{session_id}.input"

    @property
    def session_input_wildcard(self) -> str:
        return f"{self.prefix}.session.*.input"

    # Scheduler -> one worker.
    def worker_cmd(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.cmd"

    # Worker -> scheduler and provisioner. Each subject a worker publishes on names it: its
    # NATS user may publish only on its own (shared/security.py), and a subscriber drops a
    # message whose worker id is not the subject's (:func:`subject_worker`).
    def worker_heartbeat(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.heartbeat"

    @property
    def worker_heartbeats(self) -> str:
        return f"{self.prefix}.worker.*.heartbeat"

    # Worker -> worker: the session-state handoff of a migration (offers, outcomes), from
    # ``src`` to ``dst``.
    def worker_handoff(self, dst: str, src: str) -> str:
        return f"{self.prefix}.worker.{dst}.handoff.{src}"

    def worker_handoffs_to(self, dst: str) -> str:
        return f"{self.prefix}.worker.{dst}.handoff.*"

    # Source worker -> whoever asked for a migration (scheduler, ``turboserve ctl``).
    def migrations(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.migrations"

    @property
    def all_migrations(self) -> str:
        return f"{self.prefix}.worker.*.migrations"

    @property
    def provisioner_cmd(self) -> str:
        return f"{self.prefix}.provisioner.cmd"

    @property
    def provisioner_events(self) -> str:
        return f"{self.prefix}.provisioner.events"

    @property
    def provisioner_enrol(self) -> str:
        """A worker the provisioner did not start asks here for a NATS user (shared/enrol.py)."""
        return f"{self.prefix}.provisioner.enrol"

    @property
    def sessions_stream(self) -> str:
        return f"{self.prefix}_SESSIONS"

    @property
    def chunks_stream(self) -> str:
        return f"{self.prefix}_CHUNKS"


def subject_worker(subject: str) -> str:
    """The worker a ``<p>.worker.<id>...`` subject names (its third token; '' if none)."""
    tokens = subject.split(".")
    return tokens[2] if len(tokens) > 2 and tokens[1] == "worker" else ""


def subject_sender(subject: str) -> str:
    """The sender of a handoff message: the last token of ``<p>.worker.<dst>.handoff.<src>``."""
    tokens = subject.split(".")
    return tokens[4] if len(tokens) == 5 and tokens[3] == "handoff" else ""


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
    MIGRATE = "migrate"  # hand the session's state to ``target`` at its next chunk boundary
    DRAIN = "drain"  # take no new sessions (nor migrations in); worker-wide, no session_id
    UNDRAIN = "undrain"  # take sessions again; worker-wide, no session_id
    # The step budget (``steps``) for the chunks that start from now on; worker-wide. The
    # worker clamps it to its floor (TURBOSERVE_MIN_STEPS) and its model's full count.
    STEPS = "steps"


# Commands that address the worker itself rather than one of its sessions.
WORKER_WIDE_COMMANDS = frozenset({WorkerCmdKind.DRAIN, WorkerCmdKind.UNDRAIN, WorkerCmdKind.STEPS})


class WorkerStatus(enum.StrEnum):
    BOOTING = "booting"
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"
    # Only in the registry: the scheduler declared it lost (silent, or its process gone); its
    # record is shown so, with no sessions, for a while, then expires.
    LOST = "lost"


class ProvisionerCmdKind(enum.StrEnum):
    START = "start"
    STOP = "stop"


# Session and worker ids become subject tokens: a strict alphabet keeps them safe there.
MAX_WORKERS_PER_COMMAND = 1024
ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]


class _Msg(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    v: int = PROTOCOL_VERSION


class SessionInput(enum.StrEnum):
    """What a session generates from: text alone, or a live input video under the prompt."""

    TEXT = "text"
    VIDEO = "video"


# A video session's strength when its client names none: StreamDiffusionV2's starting noise
# scale. Strength is diffusers' img2img one: 0 keeps the input as it is, 1 ignores it.
DEFAULT_STRENGTH = 0.7


class SessionEvent(_Msg, tag="session_event"):
    session_id: Id
    kind: SessionEventKind
    at: float = msgspec.field(default_factory=time.time)
    prompt: str | None = None
    seed: int | None = None
    # CREATED: what the session generates from. CREATED and PROMPT of a video session: how
    # much of the input survives (0-1; None: unchanged, or the model's default).
    input: SessionInput = SessionInput.TEXT
    strength: float | None = None


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
    # MIGRATE: the destination worker.
    target: Id | None = None
    # Chosen by the requester; echoed in the CommandReply and the MigrationReport it causes.
    command_id: str = ""
    # The scheduler leadership term that sent it (0: an operator); a worker refuses a term
    # that no longer leads, so a deposed scheduler commands nobody.
    term: int = 0
    # ASSIGN: the digest of the session's client token and the name of the API key that made
    # it, so that the owner can write the session's record back if Redis loses it.
    token_hash: str = ""
    owner_key: str = ""
    # STEPS: the denoising steps per chunk from the next chunk on (the quality budget).
    steps: int | None = None
    # ASSIGN: what the session generates from; ASSIGN and PROMPT: a video session's strength.
    input: SessionInput = SessionInput.TEXT
    strength: float | None = None


class CommandReply(_Msg, tag="command_reply"):
    """A worker's answer to a command sent as a NATS request: accepted (``ok``) or refused with
    a stable ``code`` (``stale_epoch``, ``unknown_session``, ``draining``, ``busy``, ...). For
    MIGRATE, ``ok`` means the migration started; its outcome is a :class:`MigrationReport`."""

    worker_id: Id
    ok: bool
    command_id: str = ""
    code: str = ""
    detail: str = ""


class Heartbeat(_Msg, tag="heartbeat"):
    worker_id: Id
    status: WorkerStatus
    capacity: int
    active: int  # sessions on the device (executing), frozen ones included
    sessions: list[str] = msgspec.field(default_factory=list)  # every session it holds
    device: str = "cpu"
    # Measured chunk generation time per batch size (ms), from this worker's recent chunks.
    chunk_ms: dict[int, float] = msgspec.field(default_factory=dict)
    mem_free_bytes: int | None = None
    mem_total_bytes: int | None = None
    at: float = msgspec.field(default_factory=time.time)
    # What the worker really does (pacing): sessions parked in host memory, sessions that are
    # ahead of playback and sit out of the batch, the measured time of one batched pass per
    # batch size (ms), and per session how far its last chunk was ahead of its due time (ms;
    # negative: late).
    suspended: list[str] = msgspec.field(default_factory=list)
    waiting: int = 0
    pass_ms: dict[int, float] = msgspec.field(default_factory=dict)
    lead_ms: dict[str, float] = msgspec.field(default_factory=dict)
    # False when the real compute cannot keep the pace an emulated GPU kind promises.
    keeping_pace: bool = True
    emulated: str | None = None  # the GPU kind this worker emulates, if any
    gpu_kind: str = "cpu"
    chunk_period_s: float = 0.0  # the playback pace it keeps (the deadline of a chunk)
    state_bytes: int = 0  # one session's state
    # Migration: where peers reach this worker's handoff rendezvous, and the measured cost of
    # its recent handoffs (fixed ms, and ms per MiB of state).
    handoff_addr: str = ""
    handoff_fixed_ms: float | None = None
    handoff_ms_per_mib: float | None = None
    # What a prompt change adds to the chunk it applies in (the new cross-attention and, with
    # the KV re-cache, the cached frames recomputed), median of its recent switches.
    prompt_switch_ms: float | None = None
    # When the batched pass in flight ends (wall clock, seconds; its start plus the measured
    # time of a pass at its batch): the next boundary where a session can join the batch (in
    # the past while the worker waits between passes). None until it has timed a pass. The
    # scheduler's placement reads it (the policy's note_pass).
    pass_ends_at: float | None = None
    # The quality budget: the denoising steps per chunk in force, the model's full count and
    # the operator's floor (TURBOSERVE_MIN_STEPS; equal to full_steps: the budget is off).
    # 0: a worker that does not report them.
    steps: int = 0
    full_steps: int = 0
    min_steps: int = 0
    # Chunks this worker made but could not publish since it started (each one told to its
    # session's viewers as an ``unpublished`` notice).
    chunks_unpublished: int = 0


class Chunk(_Msg, tag="chunk"):
    """One chunk of a session's video: its frames as a self-contained fragmented MP4 (H.264:
    init segment + one fragment, keyframe first; services/gpu_worker/fmp4.py), at most the
    bound ``TURBOSERVE_VIDEO_BITRATE`` sets for its duration, and how it was made."""

    session_id: Id
    seq: int
    worker_id: Id
    epoch: int
    width: int
    height: int
    fps: float
    gen_ms: float  # wall time of the batched step that produced this chunk
    batch: int  # sessions in that step
    due_at: float  # when the chunk was due (wall clock, seconds)
    done_at: float  # when it was generated
    fmp4: bytes
    fmp4_mime: str = ""  # e.g. 'video/mp4; codecs="avc1.42C01E"'
    start_s: float = 0.0  # the chunk's first frame on the session's timeline (the fragment's)
    duration_s: float = 0.0  # its playback time (frames / fps)
    encode_ms: float = 0.0  # time spent encoding it, after gen_ms
    steps: int = 0  # the denoising steps it ran (0: a sender that does not say)
    # A video session's: the seq of the last input frame the chunk was made from (-1: none).
    input_seq: int = -1


# The largest picture an input frame may hold (width x height): a 16-megapixel camera. A small
# JPEG can declare a huge picture; the gateway and the worker refuse one beyond this.
MAX_FRAME_PIXELS = 4096 * 4096


class InputFrame(_Msg, tag="input_frame"):
    """One frame of a video-to-video session's input, as the viewer captured it, relayed by the
    gateway on ``Subjects.session_input``. ``seq`` is the client's frame counter; the worker
    groups consecutive frames into the input chunk that output chunk ``n`` is made from."""

    session_id: Id
    seq: int
    captured_at: float  # the client's capture time (unix seconds)
    received_at: float  # when the gateway took it
    image: bytes  # one encoded image (JPEG) as the client sent it
    dropped: int = 0  # frames of this session the gateway dropped before this one (total)


class StreamEnd(_Msg, tag="stream_end"):
    session_id: Id
    last_seq: int  # -1 when no chunk was produced
    reason: str = "closed"


class NoticeKind(enum.StrEnum):
    # a worker took the session and generates it (or kept it under a new epoch: a migration
    # that did not complete)
    PLACED = "placed"
    MIGRATED = "migrated"  # the session now runs on another worker, from ``next_seq``
    SUSPENDED = "suspended"  # idle: state parked in host memory, no chunks
    RESUMED = "resumed"  # active again
    RESTARTED = "restarted"  # the state was lost: the video starts over from the prompt
    RECOVERED = "recovered"  # its worker was lost; rebuilt on another from its log, from next_seq
    PROMPT = "prompt"  # a new prompt conditions the chunks from ``next_seq`` on
    # the chunk before ``next_seq`` was made but could not be published (NATS refused it or
    # was away, or it could not be encoded within its bound; ``detail`` says which): the
    # video skips it and goes on at ``next_seq``
    UNPUBLISHED = "unpublished"


class SessionNotice(_Msg, tag="session_notice"):
    """A lifecycle change a viewer should know of, sent on the session's chunk subject between
    its chunks (the gateway relays it as ``event: state``)."""

    session_id: Id
    kind: NoticeKind
    worker_id: Id
    epoch: int
    next_seq: int  # the seq of the next chunk the session will get
    detail: str = ""
    at: float = msgspec.field(default_factory=time.time)


# --- migration (source worker <-> destination worker) ----------------------------------------


class TensorSpec(msgspec.Struct, frozen=True):
    shape: list[int]
    dtype: str  # torch dtype name without the "torch." prefix


class HandoffOffer(_Msg, tag="handoff_offer"):
    """Source -> destination: a frozen session's state is ready to move (request; the answer
    is a :class:`HandoffAnswer`). ``epoch`` is the session's epoch while migrating.

    ``transport`` is the one the source asks for (``auto`` or a name); the destination picks
    the one used. ``rendezvous`` (strings): ``store`` (the source's rendezvous, host:port),
    ``device`` and ``uuid`` (where the state is: ``cpu`` or ``cuda:N`` and the GPU's UUID),
    ``new_link`` (the id of a link built for this transfer), ``link.<transport>`` (the links
    the source already holds to the destination) and ``tag`` (the transfer's first tag).
    The offer travels over the authenticated NATS connection; the state travels over the
    transport, which is not authenticated: the checksum is what ties the two."""

    transfer_id: str
    session_id: Id
    epoch: int
    src: Id
    dst: Id
    transport: str  # asked for: "auto", "gloo", "nccl", "cuda_ipc"
    rendezvous: dict[str, str] = msgspec.field(default_factory=dict)  # transport-specific
    tensors: list[TensorSpec] = msgspec.field(default_factory=list)
    nbytes: int = 0
    # HMAC-SHA256 of the state under ``secret``, a one-time key (both hex): the destination
    # adopts only state that matches it. Empty: not checked (only where both sides measure
    # without it).
    checksum: str = ""
    secret: str = ""
    suspended: bool = False  # the state is parked in host memory (moves host to host)
    # The session beside its tensors (the engine's snapshot fields).
    next_seq: int = 0  # wire seq of the next chunk
    engine_seq: int = 0
    position: int = 0
    prompt: str = ""
    pending_prompt: str | None = None
    seed: int = 0
    input: SessionInput = SessionInput.TEXT
    strength: float | None = None
    preset: str = ""
    dtype: str = ""
    meta: dict[str, str] = msgspec.field(default_factory=dict)
    due_at: float = 0.0  # when the session's next chunk is due (the viewer's clock moves on)
    command_id: str = ""


class HandoffAnswer(_Msg, tag="handoff_answer"):
    transfer_id: str
    accepted: bool
    code: str = ""  # refusal: draining, full, stale_epoch, incompatible, ...
    detail: str = ""
    transport: str = ""  # accepted: the transport both sides use
    rendezvous: dict[str, str] = msgspec.field(default_factory=dict)  # accepted: ``link`` (its id)


class HandoffOutcome(_Msg, tag="handoff_outcome"):
    """Destination -> source after the transfer: ``committed`` (ownership moved in Redis at
    ``epoch``; the source must never publish the session again) or aborted with a reason.
    Source -> destination (``committed`` false, code ``aborted``): the source gave up, the
    destination discards what it is receiving."""

    transfer_id: str
    session_id: Id
    committed: bool
    epoch: int = 0
    code: str = ""
    detail: str = ""


class MigrationReport(_Msg, tag="migration_report"):
    """The source's account of one migration, on ``<prefix>.migrations``."""

    session_id: Id
    src: Id
    dst: Id
    ok: bool
    command_id: str = ""
    code: str = ""  # why it failed (stable): refused, transfer_failed, timeout, stale_epoch, ...
    detail: str = ""
    epoch: int = 0  # the session's epoch afterwards
    nbytes: int = 0
    suspended: bool = False
    transport: str = ""  # the transport used ("" when nothing moved)
    freeze_ms: float = 0.0  # reaching a chunk boundary and freezing
    offer_ms: float = 0.0  # registry CAS to migrating + offer/answer round trip
    transfer_ms: float = 0.0
    commit_ms: float = 0.0  # transfer end -> the destination's outcome (verify, CAS, adopt)
    connect_ms: float = 0.0  # building a communicator for a new peer (0 when cached)
    total_ms: float = 0.0  # the command's arrival -> this report
    at: float = msgspec.field(default_factory=time.time)


class ProvisionerCommand(_Msg, tag="provisioner_cmd"):
    """START the workers named in ``worker_ids`` (or ``count`` new ones when none is named), or
    STOP the named ones. Idempotent: a worker already booting or running is not started twice,
    one already gone is not stopped twice. Sent as a NATS request, it is answered with a
    :class:`ProvisionerReply`; what happens to each worker follows as ProvisionerEvents."""

    kind: ProvisionerCmdKind
    count: Annotated[int, msgspec.Meta(ge=0, le=MAX_WORKERS_PER_COMMAND)] = 1
    worker_ids: Annotated[list[Id], msgspec.Meta(max_length=MAX_WORKERS_PER_COMMAND)] = (
        msgspec.field(default_factory=list)
    )
    # START: the GPU kind wanted; refused (``kind_unavailable``) when the pool emulates another.
    gpu_kind: str | None = None
    # Chosen by the requester; echoed in the reply and in the events the command causes.
    command_id: str = ""


class ProvisionerRefusal(msgspec.Struct, frozen=True):
    """One worker the provisioner would not start or stop, and why (a stable ``code``).
    ``worker_id`` is empty for workers asked for by ``count``."""

    code: str
    worker_id: str = ""
    detail: str = ""


class ProvisionerReply(_Msg, tag="provisioner_reply"):
    """The answer to a ProvisionerCommand: ``started`` (booting from now on), ``stopping``,
    ``unchanged`` (already in the state asked for) and ``refused``; ``ok`` when nothing was
    refused."""

    kind: ProvisionerCmdKind
    ok: bool
    command_id: str = ""
    started: list[str] = msgspec.field(default_factory=list)
    stopping: list[str] = msgspec.field(default_factory=list)
    unchanged: list[str] = msgspec.field(default_factory=list)
    refused: list[ProvisionerRefusal] = msgspec.field(default_factory=list)


class EnrolRequest(_Msg, tag="enrol_request"):
    """A worker the provisioner did not start asks for a NATS user of its own (shared/enrol.py):
    its id, and the X25519 public key its password is to be sealed to."""

    worker_id: Id
    public_key: Annotated[str, msgspec.Meta(max_length=64)]


class EnrolReply(_Msg, tag="enrol_reply"):
    """``ok``: ``sealed`` is the worker's password, sealed to its key for its id. Otherwise
    ``code`` says why not (shared/enrol.py; ``worker_alive`` and ``unavailable`` may pass)."""

    ok: bool
    worker_id: str = ""
    sealed: str = ""
    code: str = ""
    detail: str = ""


class ProvisionerEvent(_Msg, tag="provisioner_event"):
    """What happened to one worker: BOOTING (its request was accepted; it costs from now),
    READY (its first READY heartbeat; ``boot_s`` after the request), GONE (stopped, died,
    refused; ``gpu_seconds`` it cost). ``code`` says why (stable): for GONE ``stopped``,
    ``exited``, ``boot_timeout``, ``launch_failed``, ``provisioner_stopped`` or a START
    refusal (``max_workers``, ``no_gpu``, ``kind_unavailable``); a refused STOP is reported
    with the worker's current status and ``not_drained`` or ``min_workers``."""

    worker_id: Id
    status: WorkerStatus
    detail: str = ""
    at: float = msgspec.field(default_factory=time.time)
    code: str = ""
    command_id: str = ""
    emulated: str = ""  # the GPU kind the worker emulates; empty when it is real
    gpu_kind: str = ""  # READY: the kind the worker reports
    boot_s: float | None = None
    gpu_seconds: float | None = None


_ID_RE = re.compile(ID_PATTERN)

ChunkStreamMsg = Chunk | StreamEnd | SessionNotice
HandoffMsg = HandoffOffer | HandoffOutcome
Message = (
    SessionEvent
    | WorkerCommand
    | CommandReply
    | Heartbeat
    | Chunk
    | StreamEnd
    | SessionNotice
    | ProvisionerCommand
    | ProvisionerReply
    | ProvisionerEvent
    | HandoffOffer
    | HandoffAnswer
    | HandoffOutcome
    | MigrationReport
)

M = TypeVar("M")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


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
        raise WireError(
            subject, f"protocol version {msg.v} unsupported (speaks {PROTOCOL_VERSION})"
        )
    return cast(M, msg)


class _Log(Protocol):
    def warning(self, event: str, *args: Any, **kw: Any) -> Any: ...


def decode_or_drop(subject: str, data: bytes, type_: type[M], log: _Log) -> M | None:
    """Decode, or log the bad message with its subject and fault and return None, so that the
    caller drops it. Every subscription uses this: no input ever kills a service."""
    try:
        return decode(subject, data, type_)
    except WireError as exc:
        log.warning("bad_message_dropped", subject=exc.subject, fault=exc.fault)
        return None


def sent_by(subject: str, worker_id: str, token: str, log: _Log) -> bool:
    """Whether a message that says it is from ``worker_id`` came on a subject of that worker
    (``token``: the subject's worker token, :func:`subject_worker` or :func:`subject_sender`).
    A worker's NATS user publishes only on its own subjects, so a mismatch is a forged or
    misrouted message: logged and dropped."""
    if worker_id == token:
        return True
    log.warning("worker_id_mismatch", subject=subject, claimed=worker_id)
    return False

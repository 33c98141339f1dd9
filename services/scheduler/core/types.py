"""Plain-data vocabulary of the scheduler core: GPU states, events in, decisions out.

Everything here is a frozen value so that a decision list can be logged, compared in tests,
replayed by the simulator and turned into wire messages by the live service without copying.

Contract between the core and its environments (simulator, live service):

* The environment feeds :class:`Event` values in time order to ``Policy.step`` and carries out
  the returned decisions in list order.
* A policy applies its own decisions to its view immediately; the environment reports only
  what the policy cannot know: session events (``ARRIVE``, ``ACTIVE``, ``IDLE``, ``DEPART``) and
  pool events (``GPU_READY`` when a requested GPU has booted, ``GPU_GONE`` when a GPU vanished).
* ``TICK`` carries no payload; it lets a policy re-evaluate (scale in on a quiet cluster,
  advance its volatility window, retry what a failure put off).
* A live environment also reports what went wrong with a decision and what an operator asked:
  ``MIGRATION_FAILED`` (the session is still on ``gpu_id``), ``PLACEMENT_FAILED`` (an
  ``Assign``/``Resume`` onto ``gpu_id`` did not happen: the session is on no GPU) and
  ``GPU_DRAIN`` (evacuate ``gpu_id`` and release it once empty). The simulator never sends
  them; carrying out every decision is its model.
* What the environment reports beyond these events (a session's record, a worker joining or
  heard, how a move ended) are the facts of :mod:`services.scheduler.core.pool`, whose ``Pool``
  wraps the policy and makes the decisions a real pool adds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GpuState(enum.StrEnum):
    """Lifecycle of one GPU in the pool. Every state costs money."""

    BOOTING = "booting"  # requested, not yet able to take sessions
    READY = "ready"  # takes sessions
    DRAINING = "draining"  # takes no new sessions; released once empty


class EventKind(enum.StrEnum):
    # session events
    ARRIVE = "arrive"  # a new session, active
    ACTIVE = "active"  # idle -> active: needs a GPU again
    IDLE = "idle"  # active -> idle: its state goes to host RAM
    DEPART = "depart"  # the session ends
    # pool events
    GPU_READY = "gpu_ready"  # a GPU finished booting (one the controller asked for, or not)
    GPU_GONE = "gpu_gone"  # a GPU disappeared (failure or external removal)
    GPU_DRAIN = "gpu_drain"  # an operator asks to empty a GPU and give it back
    # An operator empties a GPU and keeps it, out of placement and of the autoscaler's count,
    # until GPU_UNCORDON (or GPU_DRAIN, which gives it back once empty).
    GPU_CORDON = "gpu_cordon"
    GPU_UNCORDON = "gpu_uncordon"  # the operator takes a cordoned GPU back into placement
    # The environment will not take back a GPU the controller released, for good (its floor):
    # the controller has it again, READY.
    GPU_KEPT = "gpu_kept"
    # what happened to a decision (live environments only)
    MIGRATION_FAILED = "migration_failed"  # failed or refused: the session is still on gpu_id
    PLACEMENT_FAILED = "placement_failed"  # an Assign/Resume onto gpu_id did not happen
    # periodic re-evaluation
    TICK = "tick"


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened at time ``t`` (seconds, environment clock).

    ``gpu_kind`` goes with ``GPU_READY``: the kind of the GPU, which picks its latency profile
    (None: the kind the controller asked for, or its default kind for a GPU it did not ask
    for)."""

    t: float
    kind: EventKind
    session_id: str | None = None
    gpu_id: str | None = None
    gpu_kind: str | None = None


@dataclass(frozen=True, slots=True)
class Assign:
    """Start a session (new, or one whose GPU vanished) on ``gpu_id``."""

    session_id: str
    gpu_id: str


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move an active session's state from GPU ``src`` to GPU ``dst`` at a chunk boundary."""

    session_id: str
    src: str
    dst: str


@dataclass(frozen=True, slots=True)
class Suspend:
    """Active -> idle: park the session's state in host RAM and free its slot on ``gpu_id``."""

    session_id: str
    gpu_id: str


@dataclass(frozen=True, slots=True)
class Resume:
    """Idle -> active: bring the session's state from host RAM onto ``gpu_id``."""

    session_id: str
    gpu_id: str


@dataclass(frozen=True, slots=True)
class RequestGpus:
    """Ask the pool for new GPUs, named by the controller. They are BOOTING and cost money from
    this decision on; the environment sends ``GPU_READY`` for each once it has booted."""

    gpu_ids: tuple[str, ...]
    kind: str


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop placing sessions on ``gpu_id``; it will be released once empty (after a scale-in,
    or an operator's ``GPU_DRAIN``)."""

    gpu_id: str


@dataclass(frozen=True, slots=True)
class Release:
    """Give ``gpu_id`` back to the pool. Only ever emitted for a GPU that holds no active
    session in the controller's view; a BOOTING GPU may be released (the request is cancelled).

    A ``Release`` may follow ``Migrate`` decisions off the same GPU in one list (a drain): the
    environment gives the GPU back once those migrations are done. If one fails, it reports
    ``MIGRATION_FAILED`` and keeps the GPU; the controller takes the GPU back as DRAINING and
    emits ``Release`` again once it is empty."""

    gpu_id: str


@dataclass(frozen=True, slots=True)
class SetSteps:
    """Run the chunks that start on ``gpu_id`` from now on with ``steps`` denoising steps (the
    quality budget): fewer than the model's full count while the GPU is over its budget, the
    full count again once it has room. Emitted only when a GPU's budget changes."""

    gpu_id: str
    steps: int


Decision = Assign | Migrate | Suspend | Resume | RequestGpus | Drain | Release | SetSteps


# ---- what a restarted scheduler finds (Controller.restore) ------------------------------------


@dataclass(frozen=True, slots=True)
class RestoredGpu:
    """A GPU a restarted scheduler finds in the pool: its kind and state; ``cordoned``: a
    DRAINING one an operator keeps (see ``GPU_CORDON``), not released once empty."""

    gpu_id: str
    kind: str
    state: GpuState
    cordoned: bool = False


@dataclass(frozen=True, slots=True)
class RestoredSession:
    """A live session a restarted scheduler finds.

    ``gpu_id``: the GPU generating it (None: it has none, e.g. pending). ``in_host_ram``: its
    state is parked in host memory (it was suspended), so it comes back with ``Resume``, not
    ``Assign``."""

    session_id: str
    active: bool
    gpu_id: str | None = None
    in_host_ram: bool = False


__all__ = [
    "Assign",
    "Decision",
    "Drain",
    "Event",
    "EventKind",
    "GpuState",
    "Migrate",
    "Release",
    "RequestGpus",
    "RestoredGpu",
    "RestoredSession",
    "Resume",
    "SetSteps",
    "Suspend",
]

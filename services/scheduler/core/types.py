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
  advance its volatility window).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GpuState(enum.StrEnum):
    """Lifecycle of one GPU in the pool. Every state costs money."""

    BOOTING = "booting"    # requested, not yet able to take sessions
    READY = "ready"        # takes sessions
    DRAINING = "draining"  # takes no new sessions; released once empty


class EventKind(enum.StrEnum):
    # session events
    ARRIVE = "arrive"      # a new session, active
    ACTIVE = "active"      # idle -> active: needs a GPU again
    IDLE = "idle"          # active -> idle: its state goes to host RAM
    DEPART = "depart"      # the session ends
    # pool events
    GPU_READY = "gpu_ready"  # a requested GPU finished booting
    GPU_GONE = "gpu_gone"    # a GPU disappeared (failure or external removal)
    # periodic re-evaluation
    TICK = "tick"


SESSION_EVENTS = frozenset({EventKind.ARRIVE, EventKind.ACTIVE, EventKind.IDLE, EventKind.DEPART})
POOL_EVENTS = frozenset({EventKind.GPU_READY, EventKind.GPU_GONE})


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened at time ``t`` (seconds, environment clock)."""

    t: float
    kind: EventKind
    session_id: str | None = None
    gpu_id: str | None = None


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
    """Stop placing sessions on ``gpu_id``; it will be released once empty."""

    gpu_id: str


@dataclass(frozen=True, slots=True)
class Release:
    """Give ``gpu_id`` back to the pool. Only ever emitted for a GPU that holds no active
    session; a BOOTING GPU may be released (the request is cancelled)."""

    gpu_id: str


Decision = Assign | Migrate | Suspend | Resume | RequestGpus | Drain | Release

__all__ = [
    "POOL_EVENTS",
    "SESSION_EVENTS",
    "Assign",
    "Decision",
    "Drain",
    "Event",
    "EventKind",
    "GpuState",
    "Migrate",
    "Release",
    "RequestGpus",
    "Resume",
    "Suspend",
]

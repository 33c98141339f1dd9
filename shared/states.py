"""The session lifecycle as one table of allowed transitions (no I/O).

```
 arrive --> pending --place--> executing <--idle/active--> suspended
                                 |  ^                          |
                       migrate   |  |  (chunk boundary)        | depart / timeout
                                 v  |                          v
                              migrating                   terminated
```
Redis only persists the state; every change goes through :func:`check_transition`, and the
registry's compare-and-set applies it atomically with the epoch bump.
"""

from __future__ import annotations

import enum


class SessionState(enum.StrEnum):
    PENDING = "pending"  # created, waiting for a slot on a worker
    EXECUTING = "executing"  # state on a worker's device, chunks flowing
    SUSPENDED = "suspended"  # idle: state parked in the worker's host memory
    MIGRATING = "migrating"  # state being handed from one worker to another
    TERMINATED = "terminated"  # over; final


S = SessionState

TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    S.PENDING: frozenset({S.EXECUTING, S.TERMINATED}),
    # executing -> pending: its worker died before the state could be saved; replaced anew.
    S.EXECUTING: frozenset({S.SUSPENDED, S.MIGRATING, S.PENDING, S.TERMINATED}),
    S.SUSPENDED: frozenset({S.EXECUTING, S.MIGRATING, S.PENDING, S.TERMINATED}),
    S.MIGRATING: frozenset({S.EXECUTING, S.SUSPENDED, S.PENDING, S.TERMINATED}),
    S.TERMINATED: frozenset(),
}

TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


class IllegalTransition(ValueError):
    """A state change the lifecycle does not allow; retrying cannot help."""

    retryable = False

    def __init__(self, current: SessionState, target: SessionState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "none (terminal)"
        super().__init__(f"session cannot go from {current} to {target} (allowed: {allowed})")
        self.current = current
        self.target = target


def can_transition(current: SessionState, target: SessionState) -> bool:
    return target in TRANSITIONS[current]


def check_transition(current: SessionState, target: SessionState) -> None:
    if not can_transition(current, target):
        raise IllegalTransition(current, target)


def sources_of(target: SessionState) -> frozenset[SessionState]:
    """Every state from which ``target`` may be entered."""
    return frozenset(s for s, nxt in TRANSITIONS.items() if target in nxt)

"""What the handoff needs from the worker that holds the sessions.

The worker implements :class:`StateHost` over its engine and generation loop;
:class:`~tools.handoff.synthetic.SyntheticHost` implements it over plain tensors
for the tests and the benchmark. The endpoint calls it in this order:

- source: ``freeze`` (at the session's next chunk boundary) -> then exactly one of ``release``
  (the destination committed) or ``unfreeze`` (aborted; with the session's new epoch);
- destination: ``admission`` (may it take the session?) -> ``reserve`` -> ``receive_buffers``
  -> then exactly one of ``adopt`` (after the ownership commit; consumes the reservation) or
  ``unreserve``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..engine.types import SessionSnapshot
from .codes import HandoffCode


@dataclass(slots=True)
class FrozenSession:
    """A session stopped at a chunk boundary, ready to move."""

    snapshot: SessionSnapshot  # tensors on the host, or on the device when asked and executing
    next_seq: int  # wire seq of its next chunk
    due_at: float  # when that chunk is due (wall clock: the viewer's clock carries over)
    suspended: bool  # parked in host memory (it stays suspended on the destination)


@dataclass(frozen=True, slots=True)
class HandoffRefusal:
    """Why a destination will not take a session: a stable code and a line for operators."""

    code: HandoffCode
    detail: str = ""


class HostRefused(Exception):
    """``StateHost.freeze`` cannot freeze the session (unknown, stale epoch, busy)."""

    retryable = False

    def __init__(self, code: HandoffCode, detail: str = "") -> None:
        super().__init__(f"{code}: {detail}" if detail else str(code))
        self.code = code
        self.detail = detail


class StateHost(Protocol):
    worker_id: str
    device: str  # "cpu" or "cuda:N": where state received on the device lands

    async def freeze(self, session_id: str, epoch: int, *, on_device: bool) -> FrozenSession:
        """Stop the session at its next chunk boundary and return its state. ``epoch`` is the
        one the command carries: raise :class:`HostRefused` (``stale_epoch``) when the session
        is here at another one, ``unknown_session`` or ``busy`` (already frozen). With
        ``on_device`` an executing session's tensors may stay on the device (they must not
        change until ``release`` or ``unfreeze``). Must be cancellation-safe: if cancelled,
        the session is left unfrozen."""
        ...

    async def unfreeze(self, session_id: str, epoch: int) -> None:
        """The handoff was aborted: continue the session where it stopped, now at ``epoch``
        (its progress writes must carry it)."""
        ...

    async def release(self, session_id: str) -> None:
        """The destination owns the session now: forget it and never publish it again."""
        ...

    def admission(self, incoming: FrozenSession) -> HandoffRefusal | None:
        """May this worker take ``incoming``? Its tensors are on the ``meta`` device (shapes
        and dtypes only), so compatibility can be checked before a byte moves. None: yes."""
        ...

    def receive_buffers(self, incoming: FrozenSession, device: str) -> list[torch.Tensor] | None:
        """Tensors to receive ``incoming``'s state into (its shapes and dtypes, on ``device``:
        ``cpu`` or this host's device), e.g. the host's spare page-locked buffers; they are
        handed back in ``adopt``. None: the endpoint allocates. Receiving into memory that is
        already mapped is worth it: fresh buffers cost a page fault per page (on this 2-core
        machine 256 MiB arrived at 0.5-1.1 GB/s into fresh memory, 2.6-2.9 GB/s into reused)."""
        ...

    def reserve(self, session_id: str) -> None:
        """Hold room for the session until ``adopt`` or ``unreserve``."""
        ...

    def unreserve(self, session_id: str) -> None: ...

    async def adopt(self, frozen: FrozenSession, epoch: int) -> None:
        """Take the session (ownership already moved to this worker at ``epoch``): import its
        state and generate from ``frozen.next_seq`` (or keep it parked when suspended)."""
        ...

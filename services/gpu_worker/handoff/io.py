"""What the handoff's two roles need from the worker's endpoint: a narrow I/O object.

``HandoffEndpoint`` (``endpoint.py``) is the one implementation; the roles (``source.py``,
``destination.py``) take it as a :class:`HandoffIO` and never import the endpoint, so the
endpoint can hold them without a circle. The roles see no NATS connection and no registry:
only the verbs below, whose failures come back as the errors of this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

import structlog
import torch

from shared.registry import SessionRecord
from shared.states import SessionState
from shared.wire import HandoffAnswer, HandoffOffer, HandoffOutcome, MigrationReport

from .host import StateHost
from .links import Links
from .selection import Place
from .stats import HandoffSample
from .transports import Transport

T = TypeVar("T")


class RegistryLost(Exception):
    """A compare-and-set found the session changed: another epoch, state or owner, or gone."""


class RegistryDown(Exception):
    """The registry could not be reached; the detail is the client's error."""


class NoAnswer(Exception):
    """The offer got no usable answer. ``delivered``: it may have reached the destination
    (the answer timed out or did not decode), so the destination is told of an abort."""

    def __init__(self, detail: str, *, delivered: bool) -> None:
        super().__init__(detail)
        self.detail = detail
        self.delivered = delivered


class HandoffIO(Protocol):
    worker_id: str
    place: Place  # this worker's device (and GPU UUID)
    preferred_transport: str  # ``TURBOSERVE_HANDOFF_TRANSPORT``
    timeout_s: float  # a handoff's whole budget
    checksum: bool  # offers carry a keyed checksum of the state, and offers here must
    host: StateHost
    log: structlog.stdlib.BoundLogger

    @property
    def closing(self) -> bool: ...

    @property
    def address(self) -> str: ...

    @property
    def links(self) -> Links: ...

    # -- the registry ---------------------------------------------------------------------
    async def move(
        self, session_id: str, state: SessionState, expected_epoch: int, owner: str | None
    ) -> SessionRecord:
        """The session's compare-and-set; raises :class:`RegistryLost` or
        :class:`RegistryDown`."""
        ...

    async def read(self, session_id: str) -> SessionRecord | None:
        """The session's record; raises :class:`RegistryDown`."""
        ...

    # -- the peers ------------------------------------------------------------------------
    async def ask(self, offer: HandoffOffer, timeout_s: float) -> HandoffAnswer:
        """Offer ``offer`` to its destination and wait for the answer; raises
        :class:`NoAnswer`."""
        ...

    async def tell(self, worker_id: str, outcome: HandoffOutcome) -> None:
        """Send an outcome (or an abort notice) to a peer; a failure is logged, not raised."""
        ...

    def expect_outcome(self, transfer_id: str) -> asyncio.Future[HandoffOutcome]:
        """Where the destination's outcome for ``transfer_id`` will land."""
        ...

    def forget_outcome(self, transfer_id: str) -> None: ...

    async def report(self, report: MigrationReport) -> None:
        """Publish a migration's report and record it among the cluster's events."""
        ...

    # -- the transfer ---------------------------------------------------------------------
    def transport(self, name: str) -> Transport:
        """Raises ValueError for a transport this worker does not know."""
        ...

    def link_device(self, transport: str) -> torch.device: ...

    def send_lock(self, peer: str) -> asyncio.Lock: ...

    def next_tag(self) -> int: ...

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking call off the event loop."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]: ...

    def record(self, sample: HandoffSample) -> None: ...

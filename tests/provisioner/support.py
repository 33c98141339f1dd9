"""Helpers for the provisioner's tests: its events as a log to wait on, its commands as
requests."""

from __future__ import annotations

import asyncio
import time

from shared.runner import subscriptions_live
from shared.wire import (
    ProvisionerCmdKind,
    ProvisionerCommand,
    ProvisionerEvent,
    ProvisionerReply,
    WorkerStatus,
    decode,
    encode,
)


class EventLog:
    """Every ProvisionerEvent of one subject prefix, in order of arrival."""

    def __init__(self) -> None:
        self.events: list[ProvisionerEvent] = []
        self._changed = asyncio.Event()
        self._sub = None

    @classmethod
    async def listen(cls, nc, subjects) -> EventLog:
        log = cls()

        async def on_event(msg) -> None:
            log.events.append(decode(msg.subject, msg.data, ProvisionerEvent))
            log._changed.set()

        log._sub = await nc.subscribe(subjects.provisioner_events, cb=on_event)
        await subscriptions_live(nc)  # before anything is asked of the provisioner
        return log

    def of(self, worker_id: str) -> list[ProvisionerEvent]:
        return [e for e in self.events if e.worker_id == worker_id]

    def statuses(self, worker_id: str) -> list[WorkerStatus]:
        return [e.status for e in self.of(worker_id)]

    async def wait(
        self,
        worker_id: str | None,
        status: WorkerStatus,
        timeout: float = 30.0,
        code: str | None = None,
    ) -> ProvisionerEvent:
        """The first event of ``worker_id`` (any worker: None) with ``status`` (and ``code``)."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if (
                    worker_id in (None, event.worker_id)
                    and event.status is status
                    and code in (None, event.code)
                ):
                    return event
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {status} event for {worker_id} in {timeout}s: {self.events}"
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=remaining)
            except TimeoutError:
                pass


async def request(
    nc,
    subjects,
    kind: ProvisionerCmdKind,
    worker_ids=(),
    count: int = 1,
    timeout: float = 10.0,
    **fields,
) -> ProvisionerReply:
    """Send a command as a NATS request and decode the reply."""
    cmd = ProvisionerCommand(kind=kind, worker_ids=list(worker_ids), count=count, **fields)
    msg = await nc.request(subjects.provisioner_cmd, encode(cmd), timeout=timeout)
    return decode(msg.subject, msg.data, ProvisionerReply)


def refused(reply: ProvisionerReply) -> list[tuple[str, str]]:
    return [(r.worker_id, r.code) for r in reply.refused]

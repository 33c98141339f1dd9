"""Worker and provisioner commands sent as NATS requests, retried until answered.

A command is retried with backoff while nobody answers (a worker busy starting, a message lost)
and dropped once superseded (the session moved on: a newer epoch in the registry) or after its
attempts. Commands are idempotent on the worker (an ASSIGN at the epoch it already runs, a
SUSPEND of a suspended session), so a retry after a lost reply does no harm.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared.logging import get_logger
from shared.runner import ServiceContext
from shared.wire import (
    CommandReply,
    ProvisionerCommand,
    ProvisionerReply,
    WireError,
    WorkerCommand,
    decode,
    encode,
)

log = get_logger("turboserve.scheduler")

SUPERSEDED = "superseded"  # why a command was dropped unsent: its session moved on


@dataclass(frozen=True, slots=True)
class CommandOutcome:
    """How a worker command ended: answered (``reply``), or given up (``reply`` None, ``why``:
    ``superseded`` when the session moved on before a retry)."""

    reply: CommandReply | None
    why: str = ""

    @property
    def ok(self) -> bool:
        return self.reply is not None and self.reply.ok

    @property
    def superseded(self) -> bool:
        return self.reply is None and self.why == SUPERSEDED

    @property
    def code(self) -> str:
        if self.reply is None:
            return "unanswered"
        return self.reply.code


class CommandSender:
    def __init__(
        self,
        ctx: ServiceContext,
        *,
        term: int,
        reply_timeout_s: float = 2.0,
        attempts: int = 5,
        backoff_s: float = 0.2,
    ) -> None:
        self.ctx = ctx
        self.term = term
        self.reply_timeout_s = reply_timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self._ids = itertools.count(1)

    def stamp(self, cmd: WorkerCommand) -> WorkerCommand:
        """The command with this scheduler's term and a command id."""
        return msgspec.structs.replace(
            cmd, term=self.term, command_id=cmd.command_id or f"s{self.term}-{next(self._ids)}"
        )

    async def to_worker(
        self, cmd: WorkerCommand, superseded: Callable[[], Awaitable[bool]] | None = None
    ) -> CommandOutcome:
        """Send until answered; ``superseded`` is asked before each retry."""
        cmd = self.stamp(cmd)
        subject = self.ctx.subjects.worker_cmd(cmd.worker_id)
        delay = self.backoff_s
        why = ""
        for attempt in range(self.attempts):
            if attempt and superseded is not None and await superseded():
                return CommandOutcome(None, SUPERSEDED)
            try:
                msg = await self.ctx.nc.request(subject, encode(cmd), timeout=self.reply_timeout_s)
            except NoRespondersError:
                why = f"no worker {cmd.worker_id} listening"
            except NatsTimeout:
                why = f"worker {cmd.worker_id} did not answer in {self.reply_timeout_s}s"
            else:
                try:
                    return CommandOutcome(decode(msg.subject, msg.data, CommandReply))
                except WireError as exc:
                    why = str(exc)
            log.info(
                "command_retry",
                kind=str(cmd.kind),
                worker_id=cmd.worker_id,
                session_id=cmd.session_id,
                attempt=attempt + 1,
                why=why,
            )
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)
        return CommandOutcome(None, why)

    async def to_provisioner(self, cmd: ProvisionerCommand) -> ProvisionerReply | None:
        """Send a provisioner command until it is answered (None: nobody answered); what
        happens to each worker follows as provisioner events."""
        if not cmd.command_id:
            cmd = msgspec.structs.replace(cmd, command_id=f"s{self.term}-{next(self._ids)}")
        delay = self.backoff_s
        for attempt in range(self.attempts):
            try:
                msg = await self.ctx.nc.request(
                    self.ctx.subjects.provisioner_cmd, encode(cmd), timeout=self.reply_timeout_s
                )
                return decode(msg.subject, msg.data, ProvisionerReply)
            except (NoRespondersError, NatsTimeout, WireError) as exc:
                log.info(
                    "provisioner_retry",
                    kind=str(cmd.kind),
                    attempt=attempt + 1,
                    why=type(exc).__name__,
                )
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)
        return None

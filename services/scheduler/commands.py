"""Worker and provisioner commands sent as NATS requests, retried until answered.

A command is retried with backoff while nobody answers (a worker busy starting, a message lost)
and dropped once superseded (the session moved on: a newer epoch in the registry) or after its
attempts. Commands are idempotent on the worker (an ASSIGN at the epoch it already runs, a
SUSPEND of a suspended session), so a retry after a lost reply does no harm.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared.backoff import retried
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
        tries = itertools.count()

        async def send() -> CommandOutcome:
            if next(tries) and superseded is not None and await superseded():
                return CommandOutcome(None, SUPERSEDED)
            try:
                msg = await self.ctx.nc.request(subject, encode(cmd), timeout=self.reply_timeout_s)
            except NoRespondersError:
                raise _Unanswered(f"no worker {cmd.worker_id} listening") from None
            except NatsTimeout:
                raise _Unanswered(
                    f"worker {cmd.worker_id} did not answer in {self.reply_timeout_s}s"
                ) from None
            try:
                return CommandOutcome(decode(msg.subject, msg.data, CommandReply))
            except WireError as exc:
                raise _Unanswered(str(exc)) from exc

        try:
            return await retried(
                send,
                "command_retry",
                on=_Unanswered,
                first_s=self.backoff_s,
                cap_s=2.0,
                attempts=self.attempts,
                say=log.info,
                error_key="why",
                kind=str(cmd.kind),
                worker_id=cmd.worker_id,
                session_id=cmd.session_id,
            )
        except _Unanswered as exc:
            return CommandOutcome(None, str(exc))

    async def to_provisioner(self, cmd: ProvisionerCommand) -> ProvisionerReply | None:
        """Send a provisioner command until it is answered (None: nobody answered); what
        happens to each worker follows as provisioner events."""
        if not cmd.command_id:
            cmd = msgspec.structs.replace(cmd, command_id=f"s{self.term}-{next(self._ids)}")

        async def send() -> ProvisionerReply:
            msg = await self.ctx.nc.request(
                self.ctx.subjects.provisioner_cmd, encode(cmd), timeout=self.reply_timeout_s
            )
            return decode(msg.subject, msg.data, ProvisionerReply)

        try:
            return await retried(
                send,
                "provisioner_retry",
                on=(NoRespondersError, NatsTimeout, WireError),
                first_s=self.backoff_s,
                cap_s=2.0,
                attempts=self.attempts,
                say=log.info,
                error_key="why",
                kind=str(cmd.kind),
            )
        except (NoRespondersError, NatsTimeout, WireError):
            return None  # the caller says what went unanswered


class _Unanswered(Exception):
    """A worker command got no usable reply (tried again); the text says why."""

"""Driving stand-in worker processes (:mod:`.peer`) from a benchmark or a test: start one,
wait until it answers, send it commands, ask for a migration and wait for its report."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.proc import die_with_parent
from shared.registry import Registry
from shared.wire import (
    CommandReply,
    MigrationReport,
    Subjects,
    WorkerCmdKind,
    WorkerCommand,
    decode,
    encode,
)


class HarnessError(RuntimeError):
    retryable = False


def spawn_peer(
    worker_id: str,
    env: Mapping[str, str],
    *,
    device: str = "cpu",
    checksum: bool = True,
    module: str = "tools.handoff.peer",
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start a peer process (its log goes to our stderr: ``TURBOSERVE_LOG_LEVEL`` in ``env``
    quietens it); ``module`` lets a test start a peer of its own making."""
    argv = [sys.executable, "-m", module, "--device", device, *extra]
    if not checksum:
        argv.append("--no-checksum")
    child_env = {**os.environ, **env, "TURBOSERVE_WORKER_ID": worker_id}
    return subprocess.Popen(
        argv, env=child_env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent
    )


async def command(
    nc: NATS, subjects: Subjects, cmd: WorkerCommand, wait_s: float = 10.0
) -> CommandReply:
    msg = await nc.request(subjects.worker_cmd(cmd.worker_id), encode(cmd), timeout=wait_s)
    return decode(msg.subject, msg.data, CommandReply)


async def wait_ready(
    nc: NATS,
    subjects: Subjects,
    worker_id: str,
    proc: subprocess.Popen[bytes],
    wait_s: float = 60.0,
) -> None:
    """Until the peer answers a command (``undrain``, harmless)."""
    deadline = time.monotonic() + wait_s
    while True:
        if proc.poll() is not None:
            raise HarnessError(f"peer {worker_id} exited with {proc.returncode} while starting")
        try:
            await command(
                nc,
                subjects,
                WorkerCommand(kind=WorkerCmdKind.UNDRAIN, worker_id=worker_id),
                wait_s=1.0,
            )
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"peer {worker_id} did not answer within {wait_s:.0f}s"
                ) from None
            await asyncio.sleep(0.2)


async def place(
    registry: Registry,
    nc: NATS,
    subjects: Subjects,
    session_id: str,
    worker_id: str,
    layout: str,
    seed: int = 0,
) -> int:
    """Create a session in the registry, give it to ``worker_id`` and assign it there;
    returns its epoch."""
    await registry.create_session(session_id, layout, seed)
    record = await registry.claim(session_id, worker_id, 0)
    reply = await command(
        nc,
        subjects,
        WorkerCommand(
            kind=WorkerCmdKind.ASSIGN,
            worker_id=worker_id,
            session_id=session_id,
            epoch=record.epoch,
            prompt=layout,
            seed=seed,
        ),
    )
    if not reply.ok:
        raise HarnessError(f"assign {session_id} to {worker_id}: {reply.code} {reply.detail}")
    return record.epoch


class Reports:
    """Migration reports on ``<prefix>.migrations``, by command id."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self._waiting: dict[str, asyncio.Future[MigrationReport]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.all_migrations, cb=self._on_report)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_report(self, msg: Msg) -> None:
        report = decode(msg.subject, msg.data, MigrationReport)
        future = self._waiting.get(report.command_id)
        if future is not None and not future.done():
            future.set_result(report)

    async def migrate(
        self, session_id: str, src: str, dst: str, epoch: int, wait_s: float = 60.0
    ) -> MigrationReport:
        """Send MIGRATE to ``src`` and wait for the report it publishes."""
        command_id = uuid.uuid4().hex
        future: asyncio.Future[MigrationReport] = asyncio.get_running_loop().create_future()
        self._waiting[command_id] = future
        try:
            reply = await command(
                self.nc,
                self.subjects,
                WorkerCommand(
                    kind=WorkerCmdKind.MIGRATE,
                    worker_id=src,
                    session_id=session_id,
                    target=dst,
                    epoch=epoch,
                    command_id=command_id,
                ),
            )
            if not reply.ok:
                raise HarnessError(f"migrate refused by {src}: {reply.code} {reply.detail}")
            return await asyncio.wait_for(future, wait_s)
        finally:
            self._waiting.pop(command_id, None)

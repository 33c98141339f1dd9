"""Helpers for the handoff integration tests: stand-in workers in this process (a
``HandoffEndpoint`` over a ``SyntheticHost``, each with its own NATS connection) and the
checks every test repeats."""

from __future__ import annotations

from dataclasses import dataclass

import nats
import torch
from nats.aio.client import Client as NATS

from services.gpu_worker.handoff import HandoffEndpoint
from shared.registry import Registry
from shared.settings import WorkerSettings
from shared.states import SessionState
from shared.wire import Subjects, WorkerCmdKind, WorkerCommand
from tools.handoff.synthetic import Layout, SyntheticHost, expected_state

LAYOUT = Layout(nbytes=256 * 1024, layers=4)


@dataclass
class Worker:
    id: str
    host: SyntheticHost
    ep: HandoffEndpoint
    nc: NATS

    async def close(self) -> None:
        await self.ep.close()
        await self.nc.close()


async def start_worker(
    infra,
    isolation,
    registry: Registry,
    worker_id: str,
    *,
    layout: Layout = LAYOUT,
    timeout_s: float = 10.0,
    checksum: bool = True,
    capacity: int = 8,
) -> Worker:
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
    }
    settings = WorkerSettings.from_env(env, worker_id=worker_id, handoff_timeout_s=timeout_s)
    nc = await nats.connect(infra.nats_url)
    host = SyntheticHost(worker_id, layout, capacity=capacity)
    endpoint = HandoffEndpoint(
        nc,
        registry,
        Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"]),
        host,
        settings,
        checksum=checksum,
    )
    await endpoint.start()
    return Worker(worker_id, host, endpoint, nc)


async def place(
    registry: Registry,
    worker: Worker,
    session_id: str,
    seed: int = 0,
    chunks: int = 3,
    suspended: bool = False,
) -> int:
    """A session owned by ``worker`` that has played ``chunks`` chunks; returns its epoch."""
    await registry.create_session(session_id, "synthetic", seed)
    record = await registry.claim(session_id, worker.id, 0)
    worker.host.add(session_id, seed, record.epoch)
    for _ in range(chunks):
        seq = worker.host.advance(session_id)
        assert seq is not None
        assert await registry.record_progress(session_id, worker.id, record.epoch, seq)
    if suspended:
        record = await registry.transition(
            session_id, SessionState.SUSPENDED, expected_epoch=record.epoch
        )
        held = worker.host.sessions[session_id]
        held.suspended, held.epoch = True, record.epoch
    return record.epoch


def migrate(src: Worker, dst: Worker | str, session_id: str, epoch: int) -> WorkerCommand:
    target = dst if isinstance(dst, str) else dst.id
    return WorkerCommand(
        kind=WorkerCmdKind.MIGRATE,
        worker_id=src.id,
        session_id=session_id,
        target=target,
        epoch=epoch,
        command_id=f"c-{session_id}-{epoch}",
    )


def assert_state(
    worker: Worker, session_id: str, seed: int, chunks: int, layout: Layout = LAYOUT
) -> None:
    """The session is on ``worker``, bit for bit what ``chunks`` chunks make of its seed."""
    got = worker.host.state(session_id)
    want = expected_state(layout, seed, chunks)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

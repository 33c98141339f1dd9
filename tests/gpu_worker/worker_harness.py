"""A worker service in-process against the real NATS and Redis, with the test as its scheduler:
it creates sessions in the registry, claims them for the worker and sends the commands, and
reads the chunks and notices the worker publishes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from services.gpu_worker.service import WorkerService
from shared.runner import ServiceContext, running, subscriptions_live
from shared.settings import WorkerSettings
from shared.wire import (
    Chunk,
    ChunkStreamMsg,
    SessionNotice,
    StreamEnd,
    WorkerCmdKind,
    WorkerCommand,
    decode,
    encode,
)
from tests.eventually import eventually


@dataclass
class Received:
    """Everything published on the chunk subjects, per session, in arrival order."""

    chunks: dict[str, list[tuple[float, Chunk]]] = field(default_factory=lambda: defaultdict(list))
    notices: dict[str, list[SessionNotice]] = field(default_factory=lambda: defaultdict(list))

    def seqs(self, sid: str) -> list[int]:
        return [c.seq for _, c in self.chunks[sid]]


@contextlib.asynccontextmanager
async def worker_in_process(
    env: dict[str, str], **overrides: Any
) -> AsyncIterator[tuple[WorkerService, ServiceContext, Received]]:
    settings = WorkerSettings.from_env(env, **overrides)
    service = WorkerService(settings)
    received = Received()
    async with running(service, settings) as ctx:

        async def on_msg(msg: Any) -> None:
            item = decode(msg.subject, msg.data, cast("type[ChunkStreamMsg]", ChunkStreamMsg))
            if isinstance(item, Chunk):
                received.chunks[item.session_id].append((time.time(), item))
            elif isinstance(item, SessionNotice):
                received.notices[item.session_id].append(item)
            else:
                assert isinstance(item, StreamEnd)

        sub = await ctx.nc.subscribe(ctx.subjects.chunks_wildcard, cb=on_msg)
        await subscriptions_live(ctx.nc)
        try:
            yield service, ctx, received
        finally:
            await sub.unsubscribe()


async def start_session(
    ctx: ServiceContext,
    worker_id: str,
    sid: str,
    prompt: str = "p",
    seed: int = 1,
    token_hash: str = "",
) -> int:
    """Create ``sid`` in the registry, claim it for the worker, send ASSIGN; its epoch."""
    record = await ctx.registry.create_session(sid, prompt, seed, token_hash=token_hash)
    record = await ctx.registry.claim(sid, worker_id, record.epoch)
    await send(
        ctx,
        WorkerCommand(
            kind=WorkerCmdKind.ASSIGN,
            worker_id=worker_id,
            epoch=record.epoch,
            session_id=sid,
            prompt=prompt,
            seed=seed,
            seq=record.last_seq + 1,
            token_hash=token_hash,
        ),
    )
    return record.epoch


async def send(ctx: ServiceContext, cmd: WorkerCommand) -> None:
    await ctx.nc.publish(ctx.subjects.worker_cmd(cmd.worker_id), encode(cmd))
    await subscriptions_live(ctx.nc)


@contextlib.asynccontextmanager
async def mesh_context(env: dict[str, str]) -> AsyncIterator[tuple[ServiceContext, Received]]:
    """A connection of the test's own (it plays the scheduler and the viewers): registry,
    subjects, NATS, and everything published on the chunk subjects."""
    from shared.runner import close_context, open_context
    from shared.settings import CommonSettings

    ctx = await open_context(CommonSettings.from_env(env), "test")
    received = Received()

    async def on_msg(msg: Any) -> None:
        item = decode(msg.subject, msg.data, cast("type[ChunkStreamMsg]", ChunkStreamMsg))
        if isinstance(item, Chunk):
            received.chunks[item.session_id].append((time.time(), item))
        elif isinstance(item, SessionNotice):
            received.notices[item.session_id].append(item)

    sub = await ctx.nc.subscribe(ctx.subjects.chunks_wildcard, cb=on_msg)
    await subscriptions_live(ctx.nc)
    try:
        yield ctx, received
    finally:
        await sub.unsubscribe()
        await close_context(ctx)


@contextlib.asynccontextmanager
async def worker_processes(
    ctx: ServiceContext,
    env: dict[str, str],
    ids: list[str],
    per_worker: dict[str, dict[str, str]] | None = None,
    **settings: Any,
) -> AsyncIterator[dict[str, Any]]:
    """``turboserve worker`` processes with these ids, READY in the registry when this yields;
    ``settings`` become ``TURBOSERVE_*`` variables (``per_worker`` adds some for one worker)."""
    import os
    import subprocess
    import sys

    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for wid in ids:
            penv = {
                **os.environ,
                **env,
                "TURBOSERVE_WORKER_ID": wid,
                **{f"TURBOSERVE_{k.upper()}": str(v) for k, v in settings.items()},
                **(per_worker or {}).get(wid, {}),
            }
            procs[wid] = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                [sys.executable, "-m", "tools.cli", "worker"], env=penv, stdin=subprocess.DEVNULL
            )

        async def all_ready() -> bool:
            for wid, proc in procs.items():
                if proc.poll() is not None:
                    pytest.fail(f"worker {wid} exited with {proc.returncode}")
            ready = {
                w.id for w in await ctx.registry.workers() if w.alive and w.status.value == "ready"
            }
            assert ready >= set(ids), f"not ready: {sorted(set(ids) - ready)}"
            return True

        await eventually(all_ready, 120, "the workers ready", interval=0.1)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)

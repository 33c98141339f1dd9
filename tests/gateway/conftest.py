"""Fixtures for the gateway: the gateway in-process on the real NATS and Redis, a stand-in
worker that publishes chunks and notices on the wire, and an SSE reader."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from services.gateway.service import GatewayService
from services.gateway.store import GatewayStore
from services.gpu_worker.fmp4 import Fragment, chunk_start_s, encode_chunk
from shared.registry import Registry
from shared.runner import ServiceContext, running
from shared.settings import GatewaySettings
from shared.wire import Chunk, NoticeKind, SessionNotice, StreamEnd, Subjects, encode
from tools.servers import free_port

API_KEY = "k-test-0123456789abcdef"
OTHER_KEY = "k-other-0123456789abcdef"
OPERATOR_KEY = "op-test-0123456789abcdef"


@pytest.fixture
def gw_env(infra, isolation) -> dict[str, str]:
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
        "TURBOSERVE_API_KEYS": f"alice:{API_KEY},bob:{OTHER_KEY}",
        "TURBOSERVE_OPERATOR_KEY": OPERATOR_KEY,
        "TURBOSERVE_CONTROL_WAIT_S": "3",
    }


class Gw:
    """A running gateway: its URL, its service object and its context."""

    def __init__(self, url: str, service: GatewayService, ctx: ServiceContext) -> None:
        self.url = url
        self.service = service
        self.ctx = ctx

    @property
    def gateway(self):
        assert self.service.gateway is not None
        return self.service.gateway

    @property
    def store(self) -> GatewayStore:
        return self.gateway.store


@contextlib.asynccontextmanager
async def run_gateway(env: dict[str, str], **overrides: Any) -> AsyncIterator[Gw]:
    port = free_port()
    settings = GatewaySettings.from_env(env, port=port, **overrides)
    service = GatewayService(settings)
    async with running(service, settings) as ctx:
        yield Gw(f"http://127.0.0.1:{port}", service, ctx)


@pytest.fixture
async def gw(gw_env, nats_client, redis_client) -> AsyncIterator[Gw]:
    # nats_client and redis_client clean this test's streams and keys afterwards.
    async with run_gateway(gw_env) as g:
        yield g


@pytest.fixture
async def http(gw) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(gw.url) as client:
        yield client


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def create(http: aiohttp.ClientSession, key: str = API_KEY, **body: Any) -> dict[str, Any]:
    resp = await http.post("/v1/sessions", json={"prompt": "a fox", **body}, headers=bearer(key))
    assert resp.status == 201, await resp.text()
    return await resp.json()


def picture(width: int = 16, height: int = 16, shade: int = 128) -> np.ndarray:
    """One frame of a flat colour (RGB ``[H, W, 3]``)."""
    frame = np.empty((height, width, 3), np.uint8)
    frame[:] = (shade, 64, 200)
    return frame


@functools.lru_cache(maxsize=256)
def fragment(width: int, height: int, shade: int, frames: int, seq: int = 0) -> Fragment:
    """A chunk's fragment as a worker encodes it: ``frames`` frames of one picture (cached:
    the same picture encodes to the same bytes)."""
    stack = np.stack([picture(width, height, shade)] * frames)
    return encode_chunk(stack, 16.0, chunk_start_s(seq, frames / 16.0))


class FakeWorker:
    """Publishes on a session's chunk subject exactly what a worker would. With ``registry``,
    the session is first made its own there at the epoch it publishes under, as a scheduler's
    claim would have (the gateway relays only the registry's owner); without, it publishes as
    whoever it says it is, owner or not."""

    def __init__(
        self, nc, subjects: Subjects, worker_id: str = "wfake", registry: Registry | None = None
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.worker_id = worker_id
        self.registry = registry

    async def own(self, session_id: str, epoch: int) -> None:
        """The session is this worker's at ``epoch`` in the registry, unless the registry has
        it at a later epoch, or another owner at this one (the state is left as it is)."""
        if self.registry is None:
            return
        found = await self.registry.session_owner(session_id)
        if found is None:
            return
        owner, current = found
        if current < epoch or (current == epoch and not owner):
            await self.registry.r.hset(
                self.registry.session_key(session_id),
                mapping={"owner": self.worker_id, "epoch": epoch},
            )

    async def chunk(
        self,
        session_id: str,
        seq: int,
        *,
        late_s: float = 0.0,
        frames: int = 2,
        epoch: int = 1,
        width: int = 16,
        height: int = 16,
        shade: int | None = None,
        fmp4: bytes | None = None,
    ) -> None:
        """A chunk of ``frames`` frames of a flat picture (``shade``: default from the seq), or
        of the fragment ``fmp4`` as given."""
        await self.own(session_id, epoch)
        now = time.time()
        made = fragment(width, height, seq % 255 if shade is None else shade, frames)
        msg = Chunk(
            session_id=session_id,
            seq=seq,
            worker_id=self.worker_id,
            epoch=epoch,
            width=width,
            height=height,
            fps=16.0,
            gen_ms=12.5,
            batch=1,
            due_at=now - late_s,
            done_at=now,
            fmp4=made.data if fmp4 is None else fmp4,
            fmp4_mime=made.mime,
            start_s=seq * made.duration_s,
            duration_s=made.duration_s,
        )
        await self.nc.publish(self.subjects.chunks(session_id), encode(msg))

    async def notice(
        self, session_id: str, kind: NoticeKind, next_seq: int, detail: str = "", epoch: int = 1
    ) -> None:
        await self.own(session_id, epoch)
        msg = SessionNotice(
            session_id=session_id,
            kind=kind,
            worker_id=self.worker_id,
            epoch=epoch,
            next_seq=next_seq,
            detail=detail,
        )
        await self.nc.publish(self.subjects.chunks(session_id), encode(msg))

    async def end(self, session_id: str, last_seq: int) -> None:
        await self.nc.publish(
            self.subjects.chunks(session_id),
            encode(StreamEnd(session_id=session_id, last_seq=last_seq)),
        )


@pytest.fixture
def worker(nats_client, redis_client, isolation) -> FakeWorker:
    registry = Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    return FakeWorker(
        nats_client, Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"]), registry=registry
    )


async def read_sse(
    resp: aiohttp.ClientResponse,
    want: int,
    timeout: float = 20.0,
    until: str | None = "end",
    until_id: str | None = None,
) -> list[dict[str, str]]:
    """Parse SSE events (event/id/data) until ``want`` events, an ``until`` event or the event
    with id ``until_id``."""
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    async with asyncio.timeout(timeout):
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if not line:
                if "event" in current or "data" in current:
                    events.append(current)
                    if (
                        len(events) >= want
                        or current.get("event") == until
                        or (until_id is not None and current.get("id") == until_id)
                    ):
                        return events
                current = {}
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data" and "data" in current:  # an event's lines, joined as SSE says
                value = current["data"] + "\n" + value
            current[field] = value
    return events

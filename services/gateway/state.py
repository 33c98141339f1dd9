"""The gateway's state: one :class:`Gateway` per app, reached by handlers as ``app[GATEWAY_STATE]``.

The gateway keeps no session state of its own: the registry (Redis) is the truth, the keys all
replicas share are in :mod:`services.gateway.store`, and chunks come from JetStream. What lives
here is per process: open feeds and viewers, this replica's attachments, metrics.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from aiohttp import web

from services.gateway import errors
from services.gateway.auth import ANONYMOUS, KeyRing, authorize_session
from services.gateway.feeds import FeedHub
from services.gateway.inputs import InputRelay
from services.gateway.metrics import GatewayMetrics
from services.gateway.store import GatewayStore
from shared.registry import Registry, SessionRecord
from shared.runner import ServiceContext
from shared.settings import GatewaySettings
from shared.wire import valid_id


@dataclass
class Gateway:
    ctx: ServiceContext
    settings: GatewaySettings
    # The gateway's own Redis client: a pool that makes a burst of requests wait for a
    # connection rather than fail (a thousand streams opening at once).
    redis: aioredis.Redis
    registry: Registry
    keys: KeyRing
    store: GatewayStore
    hub: FeedHub
    metrics: GatewayMetrics
    inputs: InputRelay  # video sessions' input frames, to their owners
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    # This replica, as its viewers' holder in Redis.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # This replica's viewers: attachment id -> session id.
    attachments: dict[str, str] = field(default_factory=dict)
    # Worst chunk latency (ms) per (worker, unix second) since the last flush to Redis.
    latency: dict[tuple[str, int], float] = field(default_factory=dict)

    def note_chunk_latency(self, worker_id: str, done_at: float, latency_ms: float) -> None:
        bucket = (worker_id, int(done_at))
        if latency_ms > self.latency.get(bucket, -1.0):
            self.latency[bucket] = latency_ms

    def take_latency(self) -> dict[tuple[str, int], float]:
        taken, self.latency = self.latency, {}
        return taken

    def url(self, path: str) -> str:
        return f"{self.settings.public_url.rstrip('/')}{path}"

    def session_body(self, record: SessionRecord, **extra: Any) -> dict[str, Any]:
        return {
            **record.to_public(),
            "stream_url": self.url(f"/v1/sessions/{record.id}/stream"),
            "ws_url": self.url(f"/v1/sessions/{record.id}/ws"),
            **extra,
        }


GATEWAY_STATE = web.AppKey("gateway", Gateway)


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


async def load_session(gw: Gateway, session_id: str) -> SessionRecord:
    record = await gw.registry.get_session(session_id) if valid_id(session_id) else None
    if record is None:
        raise errors.SessionNotFoundError(f"no session {session_id!r}", session_id=session_id)
    return record


async def authorized_session(gw: Gateway, request: web.Request) -> tuple[SessionRecord, bool]:
    """The session the route names, once the request proved it may act on it (its token or the
    operator key) and its key is within its request rate. Returns (record, is_operator)."""
    record = await load_session(gw, request.match_info["session_id"])
    operator = authorize_session(gw.keys, request, record)
    if not operator:
        await check_rate(gw, record.owner_key)
    return record, operator


async def check_rate(gw: Gateway, key_name: str) -> None:
    s = gw.settings
    verdict = await gw.store.take_request(key_name or ANONYMOUS, s.rate_per_key_s, s.rate_burst)
    if not verdict.allowed:
        raise errors.RateLimited(
            f"over {s.rate_per_key_s:g} requests/s (burst {s.rate_burst}) for this key",
            retry_after_s=verdict.retry_after_s,
            limit_per_s=s.rate_per_key_s,
            burst=s.rate_burst,
        )

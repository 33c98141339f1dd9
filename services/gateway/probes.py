"""Probes and metrics: ``/healthz`` (the process serves), ``/readyz`` (it can take work: NATS and
Redis answer, it is not shutting down, and a worker is ready to take a session, unless
``ready_without_workers`` says the pool may start at zero), ``/metrics`` (Prometheus)."""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from services.gateway.state import GATEWAY_STATE, Gateway, json_response
from shared.wire import WorkerStatus


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def _redis_ok(gw: Gateway) -> bool:
    try:
        return bool(await asyncio.wait_for(gw.redis.ping(), timeout=1.0))
    except Exception:  # noqa: BLE001 - any failure means not ready
        return False


async def _workers_ready(gw: Gateway) -> int:
    """Workers that can take a session: alive and ready (not booting, draining or lost)."""
    try:
        workers = await asyncio.wait_for(gw.registry.workers(), timeout=1.0)
    except Exception:  # noqa: BLE001 - Redis away: none that we know of
        return 0
    return sum(1 for w in workers if w.alive and w.status is WorkerStatus.READY)


async def readyz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    nats_ok = gw.ctx.nc.is_connected
    redis_ok = await _redis_ok(gw)
    closing = gw.closing.is_set()
    workers = await _workers_ready(gw) if redis_ok else 0
    needs_worker = not gw.settings.ready_without_workers
    ok = nats_ok and redis_ok and not closing and (workers > 0 or not needs_worker)
    body = {
        "status": "ok" if ok else "unavailable",
        "nats": nats_ok,
        "redis": redis_ok,
        "closing": closing,
        "workers_ready": workers,
        "needs_worker": needs_worker,
    }
    return json_response(body, status=200 if ok else 503)


async def session_counts(gw: Gateway) -> tuple[dict[str, int], dict[str, int]]:
    """Open sessions the gateways track, by registry state and by activity."""
    ids = await gw.store.tracked()
    if not ids:
        return {}, {}
    registry = gw.registry
    async with gw.redis.pipeline(transaction=False) as pipe:
        for session_id in ids:
            pipe.hget(registry.session_key(session_id), "state")
        pipe.hgetall(gw.store.activity_key)
        raw = await pipe.execute()
    states = Counter(s.decode() for s in raw[:-1] if s is not None)
    tracked = set(ids)
    activity = Counter(v.decode() for k, v in raw[-1].items() if k.decode() in tracked)
    return dict(states), dict(activity)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    gw.metrics.set_sessions(*await session_counts(gw))
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": gw.metrics.content_type})

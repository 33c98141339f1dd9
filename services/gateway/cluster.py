"""``GET /v1/cluster`` (operator key): what the dashboard shows.

Workers with their state, kind, sessions and load against the scheduler's target; the pool's
limits; the scheduler's view; recent migrations and scale events; the worst chunk latency per
second (from the chunks the gateways relayed). What no service has written yet is null.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from services.gateway.auth import require_operator
from services.gateway.state import GATEWAY_STATE, Gateway, json_response
from shared.meter import Meter
from shared.registry import WorkerRecord

LATENCY_WINDOW_S = 300
RECENT_S = 10
EVENTS_SHOWN = 50


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def worker_load(worker: WorkerRecord, scheduler: dict[str, Any] | None) -> float | None:
    """The scheduler's utilisation of this worker when it reports one (``rho`` per worker),
    else its executing sessions over its capacity."""
    per_worker = (scheduler or {}).get("rho")
    if isinstance(per_worker, dict) and (rho := _number(per_worker.get(worker.id))) is not None:
        return rho
    if worker.capacity <= 0:
        return None
    return (len(worker.sessions) - len(worker.suspended)) / worker.capacity


def worker_card(
    worker: WorkerRecord,
    scheduler: dict[str, Any] | None,
    sessions: list[dict[str, Any]],
    latency: list[tuple[int, float]],
    now: float,
) -> dict[str, Any]:
    recent = [ms for t, ms in latency if t >= now - RECENT_S]
    return {
        "id": worker.id,
        "status": str(worker.status),
        "alive": worker.alive,
        "device": worker.device,
        "gpu_kind": worker.gpu_kind,
        "emulated": worker.emulated or None,
        "capacity": worker.capacity,
        "sessions": sessions,
        "suspended": list(worker.suspended),
        "waiting": worker.waiting,
        "keeping_pace": worker.keeping_pace,
        "steps": worker.steps or None,  # the quality budget: steps per chunk in force
        "full_steps": worker.full_steps or None,
        # chunks it made but could not publish (each told to its viewers)
        "chunks_unpublished": worker.chunks_unpublished,
        "pass_ms": {str(k): v for k, v in sorted(worker.pass_ms.items())},
        "load": worker_load(worker, scheduler),
        "worst_latency_ms": max(recent) if recent else None,
        "updated_at": worker.updated_at,
    }


def merge_latency(series: dict[str, list[tuple[int, float]]]) -> list[list[float]]:
    """The worst over all workers, per second."""
    worst: dict[int, float] = {}
    for points in series.values():
        for t, ms in points:
            worst[t] = max(ms, worst.get(t, 0.0))
    return [[t, worst[t]] for t in sorted(worst)]


async def cluster_view(gw: Gateway, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    registry = gw.registry
    workers = await registry.workers()
    scheduler = await registry.scheduler_status()
    limits = await registry.pool_limits()
    events = await registry.cluster_events(EVENTS_SHOWN)
    placement = await registry.placement()
    pending = await registry.pending_sessions()
    series = await gw.store.latency_series([w.id for w in workers], int(now) - LATENCY_WINDOW_S)
    counters = await registry.counters()
    reading = await Meter(gw.ctx.redis, registry.ns).read(now)
    held: dict[str, list[str]] = {}
    for session_id, worker_id in sorted(placement.items()):
        held.setdefault(worker_id, []).append(session_id)
    cards = []
    for w in workers:
        ids = sorted(set(w.sessions) | set(held.get(w.id, [])))
        sessions = [{"id": sid, "suspended": sid in w.suspended} for sid in ids]
        cards.append(worker_card(w, scheduler, sessions, series.get(w.id, []), now))
    target = _number((scheduler or {}).get("rho_hat"))
    return {
        "at": now,
        "workers": cards,
        "target": target,
        "pool": None
        if limits is None
        else {
            "min_workers": limits.min_workers,
            "max_workers": limits.max_workers,
            "backend": limits.backend,
        },
        "scheduler": scheduler,
        "pending": pending,
        "events": events,
        "latency": merge_latency(series),
        # Since the deployment began: migrations, scale events, the largest pool (counters)
        # and the GPU-seconds spent (the provisioner's meter, booting included).
        "counters": counters,
        "cost": {"gpu_seconds": round(reading.total_s, 3), "running": reading.running},
    }


async def get_cluster(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    require_operator(gw.keys, request)
    return json_response(await cluster_view(gw))

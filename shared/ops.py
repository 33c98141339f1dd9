"""The ops endpoint every service can open: ``GET /healthz`` and Prometheus ``GET /metrics``.

A service makes its metrics in a :func:`metrics_registry` of its own (several services in one
process, as in tests, never clash) and opens the endpoint in its ``start(ctx)``::

    self.ops = await start_ops(ctx, self.metrics.registry, details=self._health)
    ...
    await self.ops.close()  # in stop(); None-safe through close_ops(self.ops)

Where it listens is ``TURBOSERVE_METRICS_PORT``: 0 = a free port on loopback, logged (local
runs, where several services share a host); N = port N on every interface (deployments, where
probes and scrapers come from outside); -1 = no endpoint.

``/healthz`` answers 200 ``{"status": "ok", "service": ..., "checks": {...}}`` while NATS is
connected and Redis answers a PING (within a second), and 503 with ``"status": "unavailable"``
and the failing checks otherwise; ``details`` adds the service's own fields to the body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from shared.logging import get_logger
from shared.runner import ServiceContext

log = get_logger("turboserve.ops")

METRICS_OFF = -1
REDIS_PING_TIMEOUT_S = 1.0

Check = Callable[[], Awaitable[bool]]
Details = Callable[[], dict[str, Any]]


def metrics_registry() -> CollectorRegistry:
    """A registry of the service's own, with the process metrics (CPU, memory, open files)."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class OpsServer:
    """``/healthz`` and ``/metrics`` on one small aiohttp server."""

    def __init__(
        self,
        service: str,
        registry: CollectorRegistry,
        checks: dict[str, Check],
        *,
        port: int = 0,
        details: Details | None = None,
    ) -> None:
        if port == METRICS_OFF:
            raise ValueError("port -1 means no ops endpoint: do not make an OpsServer")
        self.service = service
        self.registry = registry
        self.checks = checks
        self.details = details
        self.host = "127.0.0.1" if port == 0 else "0.0.0.0"
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]  # the port the OS picked when asked for 0
        log.info(
            "ops_listening",
            service=self.service,
            host=self.host,
            port=self.port,
            healthz=f"{self.url}/healthz",
            metrics=f"{self.url}/metrics",
        )

    async def close(self) -> None:
        """Stop listening (idempotent)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Run every check; ``(healthy, body)``. A check that raises counts as failed."""
        names = list(self.checks)
        results = await asyncio.gather(*(self.checks[n]() for n in names), return_exceptions=True)
        checks = {
            n: ("ok" if r is True else _failure(r)) for n, r in zip(names, results, strict=True)
        }
        healthy = all(v == "ok" for v in checks.values())
        body: dict[str, Any] = {
            "status": "ok" if healthy else "unavailable",
            "service": self.service,
            "checks": checks,
        }
        if self.details is not None:
            body.update(self.details())
        return healthy, body

    async def _healthz(self, request: web.Request) -> web.Response:
        healthy, body = await self.health()
        return web.json_response(body, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


def _failure(result: object) -> str:
    if isinstance(result, BaseException):
        return f"failed: {type(result).__name__}: {result}".rstrip(": ")
    return "failed"


def context_checks(ctx: ServiceContext) -> dict[str, Check]:
    """The checks every service shares: NATS connected, Redis answering."""

    async def nats_ok() -> bool:
        return bool(ctx.nc.is_connected)

    async def redis_ok() -> bool:
        return bool(await asyncio.wait_for(ctx.redis.ping(), timeout=REDIS_PING_TIMEOUT_S))

    return {"nats": nats_ok, "redis": redis_ok}


async def start_ops(
    ctx: ServiceContext,
    registry: CollectorRegistry,
    *,
    service: str,
    details: Details | None = None,
    checks: dict[str, Check] | None = None,
) -> OpsServer | None:
    """Open the ops endpoint where ``ctx.settings.metrics_port`` says (None when it is off).

    ``checks`` are added to the NATS and Redis ones. A port already taken raises ``OSError``:
    a deployment that names a port wants that port, so the service fails to start."""
    port = ctx.settings.metrics_port
    if port == METRICS_OFF:
        log.info("ops_off", service=service)
        return None
    server = OpsServer(
        service, registry, {**context_checks(ctx), **(checks or {})}, port=port, details=details
    )
    await server.start()
    return server


async def close_ops(server: OpsServer | None) -> None:
    if server is not None:
        await server.close()

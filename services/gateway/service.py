"""The gateway as a supervised service: an aiohttp site inside the shared runner, plus its two
loops (lifetimes, and ending the feeds of sessions that are over)."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web
from redis.exceptions import RedisError

from services.gateway import lifetimes
from services.gateway.app import build_app, build_gateway
from services.gateway.state import Gateway
from shared.logging import get_logger
from shared.runner import ServiceContext
from shared.settings import GatewaySettings
from shared.streams import ensure_streams
from shared.video import ChunkRetention

log = get_logger("turboserve.gateway")


class GatewayService:
    name = "gateway"

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway: Gateway | None = None
        self._runner: web.AppRunner | None = None
        self._loops_stop = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []

    async def start(self, ctx: ServiceContext) -> None:
        await ensure_streams(
            ctx.js, ctx.subjects, ChunkRetention.of(ctx.settings), ctx.settings.stream_replicas
        )
        gw = self.gateway = build_gateway(ctx, self.settings)
        await lifetimes.alive(gw)  # before any viewer attaches
        if gw.keys.open:
            log.warning(
                "no_api_key_configured",
                detail="anyone who reaches this gateway may create sessions; set "
                "TURBOSERVE_API_KEYS or TURBOSERVE_API_KEYS_FILE",
            )
        self._loops = [
            ctx.spawn(lifetimes.run(gw, self._loops_stop), name="gateway-lifetimes"),
            ctx.spawn(gw.hub.run_quiet_checks(self._loops_stop), name="gateway-feed-ends"),
        ]
        # Streams end on their own once the hub is closed; the timeout bounds the rest.
        self._runner = web.AppRunner(build_app(gw), access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        log.info(
            "gateway_listening",
            addresses=[f"http://{h}:{p}" for h, p, *_ in self._runner.addresses],
            api_keys=sorted(gw.keys.api_keys),
            operator_key=gw.keys.operator is not None,
        )

    async def stop(self) -> None:
        """Refuse new sessions, end open streams and sockets, stop the site (idempotent)."""
        gw = self.gateway
        if gw is not None:
            gw.closing.set()
            await gw.hub.close()
            with contextlib.suppress(RedisError):
                await gw.store.replica_gone(gw.instance_id)
        self._loops_stop.set()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._loops:  # they end within one pass; then their Redis client may go
            await asyncio.wait(self._loops, timeout=5.0)
            self._loops = []
        if gw is not None:
            await gw.redis.aclose()

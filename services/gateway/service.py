"""The gateway as a supervised service: an aiohttp site inside the shared runner."""

from __future__ import annotations

from aiohttp import web

from services.gateway.app import CLOSING, build_app
from shared.logging import get_logger
from shared.runner import ServiceContext
from shared.settings import GatewaySettings
from shared.streams import ensure_streams

log = get_logger("turboserve.gateway")


class GatewayService:
    name = "gateway"

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._runner: web.AppRunner | None = None
        self._app: web.Application | None = None

    async def start(self, ctx: ServiceContext) -> None:
        await ensure_streams(ctx.js, ctx.subjects)
        self._app = build_app(ctx, self.settings)
        # Streams end on their own when CLOSING is set; the timeout bounds the rest.
        self._runner = web.AppRunner(self._app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        log.info("gateway_listening", addresses=[f"http://{h}:{p}" for h, p, *_ in self._runner.addresses])

    async def stop(self) -> None:
        """Refuse new sessions, end open SSE streams, stop the site (idempotent)."""
        if self._app is not None:
            self._app[CLOSING].set()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

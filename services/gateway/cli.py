"""``turboserve gateway``: run the gateway (HTTP, SSE, WebSocket, the pages) on its own."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="run the gateway: HTTP API, SSE, WebSocket, playground, dashboard "
        "(TURBOSERVE_* settings)",
    )
    p.add_argument("--host", help="bind address (TURBOSERVE_HOST)")
    p.add_argument("--port", type=int, help="port (TURBOSERVE_PORT)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.gateway.service import GatewayService
    from shared.runner import run_service
    from shared.settings import GatewaySettings

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = GatewaySettings.from_env(**overrides)
    return run_service(lambda: GatewayService(settings), settings, "gateway")

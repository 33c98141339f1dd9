"""The gateway's aiohttp app: middlewares and routes.

The gateway holds no session state of its own: the registry (Redis) is the truth, session events
go to the scheduler over JetStream, and chunks come from JetStream, so any gateway replica can
serve any session and a client can reconnect to another one with ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.typedefs import Handler
from redis.exceptions import RedisError

from services.gateway import cluster, errors, probes, sessions, sse, webrtc, ws
from services.gateway.auth import KeyRing
from services.gateway.feeds import RESUBSCRIBE_ASK_S, FeedHub
from services.gateway.inputs import InputRelay
from services.gateway.jpegs import Jpegs
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import openapi_json
from services.gateway.pages import PAGES, Pages
from services.gateway.state import GATEWAY_STATE, Gateway
from services.gateway.store import GatewayStore
from shared.logging import get_logger
from shared.registry import Registry
from shared.runner import ServiceContext, redis_pool
from shared.settings import GatewaySettings

log = get_logger("turboserve.gateway")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except errors.ApiError as exc:
        error = exc
    except web.HTTPNotFound:
        error = errors.RouteNotFound(f"no route for {request.method} {request.path}")
    except web.HTTPMethodNotAllowed as exc:
        error = errors.MethodNotAllowed(
            f"{request.method} not allowed on {request.path}", allowed=sorted(exc.allowed_methods)
        )
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[GATEWAY_STATE].settings.max_body_bytes
        error = errors.PayloadTooLarge(f"request body over {limit} bytes", limit=limit)
    except web.HTTPException:
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except RedisError as exc:  # Redis away or saturated: a retry can help
        log.warning("redis_unavailable", method=request.method, path=request.path, error=str(exc))
        error = errors.Unavailable("the registry is not answering; retry")
    except Exception:
        log.exception("request_failed", method=request.method, path=request.path)
        error = errors.ApiError("internal error")
    request.app[GATEWAY_STATE].metrics.refusals.labels(error.code).inc()
    return error.response()


# Redis connections of one gateway; requests beyond them wait (up to the timeout) for one.
REDIS_CONNECTIONS = 64
REDIS_WAIT_S = 10.0


def build_gateway(ctx: ServiceContext, settings: GatewaySettings) -> Gateway:
    metrics = GatewayMetrics()
    redis = aioredis.Redis(
        connection_pool=redis_pool(
            settings.redis_url,
            settings.tls,
            REDIS_CONNECTIONS,
            REDIS_WAIT_S,
            settings.redis_wait_ms,
        )
    )
    registry = Registry(
        redis, settings.redis_namespace, settings.redis_wait_replicas, settings.redis_wait_ms
    )
    gw: Gateway

    def on_chunk(chunk: Any) -> None:
        gw.note_chunk_latency(chunk.worker_id, chunk.done_at, metrics.observe_chunk(chunk))

    hub = FeedHub(
        ctx.js,
        ctx.subjects,
        registry,
        settings.client_queue_chunks,
        on_chunk,
        jpegs=Jpegs(settings.jpeg_quality),
        on_foreign=metrics.foreign_owner_dropped.inc,
        js_retry=ctx.nc.jetstream(timeout=RESUBSCRIBE_ASK_S),
    )
    ctx.reconnect_hooks.append(hub.resubscribe_all)  # after the streams are declared again
    gw = Gateway(
        ctx=ctx,
        settings=settings,
        redis=redis,
        registry=registry,
        keys=KeyRing.from_secrets(settings.api_key_map(), settings.operator_key),
        store=GatewayStore(redis, settings.redis_namespace),
        hub=hub,
        metrics=metrics,
        inputs=InputRelay(ctx.nc, ctx.subjects, settings, metrics),
    )
    return gw


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware], client_max_size=gw.settings.max_body_bytes
    )
    app[GATEWAY_STATE] = gw
    peers = app[webrtc.PEERS] = webrtc.PeerSet()
    app.on_shutdown.append(peers.close_all)  # after the hub closed: every peer ends, then the site
    pages = Pages()
    r = app.router
    for path in PAGES:
        r.add_get(path, pages.page)
    r.add_get("/static/{name}", pages.static)
    r.add_get("/openapi.json", openapi_json)
    r.add_get("/healthz", probes.healthz)
    r.add_get("/readyz", probes.readyz)
    r.add_get("/metrics", probes.metrics)
    r.add_post("/v1/sessions", sessions.create_session)
    r.add_get("/v1/sessions/{session_id}", sessions.get_session)
    r.add_delete("/v1/sessions/{session_id}", sessions.delete_session)
    r.add_get("/v1/sessions/{session_id}/stream", sse.stream_session)
    r.add_get("/v1/sessions/{session_id}/ws", ws.session_socket)
    r.add_post("/v1/sessions/{session_id}/webrtc", webrtc.peer_offer)
    r.add_post("/v1/sessions/{session_id}/prompt", sessions.change_session_prompt)
    r.add_post("/v1/sessions/{session_id}/pause", sessions.pause_session)
    r.add_post("/v1/sessions/{session_id}/resume", sessions.resume_session)
    r.add_get("/v1/cluster", cluster.get_cluster)
    return app

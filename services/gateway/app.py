"""The gateway's HTTP API: sessions over REST, chunks over Server-Sent Events.

The gateway holds no session state of its own: the registry (Redis) is the truth, session events
go to the scheduler over JetStream, and chunks come from JetStream, so any gateway replica can
serve any session and a client can reconnect to another one with ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import secrets
import uuid
from typing import Any

import orjson
from aiohttp import web
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api as js_api

from services.gateway import errors
from shared.logging import get_logger
from shared.registry import SessionRecord, StaleEpoch
from shared.runner import ServiceContext
from shared.settings import GatewaySettings
from shared.states import IllegalTransition, SessionState
from shared.wire import (
    Chunk,
    ChunkStreamMsg,
    SessionEvent,
    SessionEventKind,
    StreamEnd,
    decode_or_drop,
    encode,
    valid_id,
)

log = get_logger("turboserve.gateway")

CTX = web.AppKey("ctx", ServiceContext)
SETTINGS = web.AppKey("settings", GatewaySettings)
CLOSING = web.AppKey("closing", asyncio.Event)

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",  # no proxy buffering in front of us
}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except errors.ApiError as exc:
        return exc.response()
    except web.HTTPNotFound:
        return errors.RouteNotFound(f"no route for {request.method} {request.path}").response()
    except web.HTTPMethodNotAllowed as exc:
        return errors.MethodNotAllowed(
            f"{request.method} not allowed on {request.path}", allowed=sorted(exc.allowed_methods)
        ).response()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].max_body_bytes
        return errors.PayloadTooLarge(f"request body over {limit} bytes", limit=limit).response()
    except web.HTTPException:
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("request_failed", method=request.method, path=request.path)
        return errors.ApiError("internal error").response()


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    token = request.app[SETTINGS].api_token
    if token and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise errors.Unauthorized("missing or wrong bearer token")
    return await handler(request)


def stream_url(settings: GatewaySettings, session_id: str) -> str:
    return f"{settings.public_url.rstrip('/')}/v1/sessions/{session_id}/stream"


def session_body(settings: GatewaySettings, record: SessionRecord) -> dict[str, Any]:
    return {**record.to_public(), "stream_url": stream_url(settings, record.id)}


async def _read_json_object(request: web.Request) -> dict[str, Any]:
    # The body is parsed as JSON whatever the Content-Type says (curl -d sends a form type by
    # default); what is not JSON gets a 400 with code invalid_json.
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as exc:
        raise errors.InvalidJson(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise errors.InvalidJson("body must be a JSON object")
    return body


def _validate_prompt(body: dict[str, Any], limit: int) -> str:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise errors.InvalidRequest("'prompt' must be a non-empty string", field="prompt")
    if len(prompt) > limit:
        raise errors.PromptTooLong(len(prompt), limit)
    return prompt


def _validate_seed(body: dict[str, Any]) -> int:
    seed = body.get("seed")
    if seed is None:
        return secrets.randbits(31)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise errors.InvalidRequest("'seed' must be an integer in [0, 2^31)", field="seed")
    return seed


async def _get_record(request: web.Request) -> SessionRecord:
    session_id = request.match_info["session_id"]
    record = None
    if valid_id(session_id):
        record = await request.app[CTX].registry.get_session(session_id)
    if record is None:
        raise errors.SessionNotFound(f"no session {session_id!r}", session_id=session_id)
    return record


async def create_session(request: web.Request) -> web.Response:
    ctx, settings = request.app[CTX], request.app[SETTINGS]
    if request.app[CLOSING].is_set():
        raise errors.Unavailable("gateway is shutting down; retry on another replica")
    body = await _read_json_object(request)
    unknown = sorted(set(body) - {"prompt", "seed"})
    if unknown:
        raise errors.InvalidRequest(f"unknown field(s): {', '.join(unknown)}", fields=unknown)
    prompt = _validate_prompt(body, settings.max_prompt_chars)
    seed = _validate_seed(body)
    session_id = uuid.uuid4().hex
    record = await ctx.registry.create_session(session_id, prompt, seed)
    # The registry's pending set is the source of truth; the event only wakes the scheduler
    # at once (it also scans pending sessions on every tick), so a failed publish loses nothing.
    event = SessionEvent(session_id=session_id, kind=SessionEventKind.CREATED, prompt=prompt, seed=seed)
    try:
        await ctx.js.publish(ctx.subjects.session_events, encode(event), timeout=2)
    except Exception as exc:  # noqa: BLE001 - see above
        log.warning("session_event_publish_failed", session_id=session_id, error=str(exc))
    log.info("session_created", session_id=session_id, prompt_chars=len(prompt))
    body_out = session_body(settings, record)
    return json_response(body_out, status=201, headers={"Location": f"/v1/sessions/{session_id}"})


async def get_session(request: web.Request) -> web.Response:
    record = await _get_record(request)
    return json_response(session_body(request.app[SETTINGS], record))


async def delete_session(request: web.Request) -> web.Response:
    """Close a session. Idempotent: a second (or concurrent) DELETE answers 200 with the record."""
    ctx = request.app[CTX]
    record = await _get_record(request)
    if record.state is not SessionState.TERMINATED:
        try:
            # Terminating bumps the epoch: the worker is fenced off at once, whatever it does.
            # The owner stays on record so that the scheduler knows which worker to stop.
            record = await ctx.registry.transition(record.id, SessionState.TERMINATED)
        except (IllegalTransition, StaleEpoch):
            record = await _get_record(request)  # someone else closed it first
        else:
            # Streams end first (the StreamEnd is what open SSE clients wait for); the event to
            # the scheduler is best effort: a worker that misses its STOP is fenced at its next
            # chunk anyway, since a terminated session takes no progress.
            end = StreamEnd(session_id=record.id, last_seq=record.last_seq, reason="closed")
            await ctx.nc.publish(ctx.subjects.chunks(record.id), encode(end))
            event = SessionEvent(session_id=record.id, kind=SessionEventKind.CLOSED)
            try:
                await ctx.js.publish(ctx.subjects.session_events, encode(event), timeout=2)
            except Exception as exc:  # noqa: BLE001 - see above
                log.warning("session_event_publish_failed", session_id=record.id, error=str(exc))
            log.info("session_closed", session_id=record.id, last_seq=record.last_seq)
    return json_response(session_body(request.app[SETTINGS], record))


def _parse_last_event_id(request: web.Request) -> int:
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        raise errors.InvalidRequest("Last-Event-ID must be an integer chunk seq", value=raw) from None
    return value


def chunk_event(chunk: Chunk) -> bytes:
    data = {
        "session_id": chunk.session_id,
        "seq": chunk.seq,
        "encoding": f"{chunk.encoding}/base64",
        "frames": [base64.b64encode(f).decode("ascii") for f in chunk.frames],
        "width": chunk.width,
        "height": chunk.height,
        "fps": chunk.fps,
        "timing": {
            "gen_ms": round(chunk.gen_ms, 3),
            "batch": chunk.batch,
            "due_at": chunk.due_at,
            "done_at": chunk.done_at,
            "latency_ms": round(max(0.0, chunk.done_at - chunk.due_at) * 1000, 3),
        },
        "worker_id": chunk.worker_id,
    }
    return b"event: chunk\nid: %d\ndata: %s\n\n" % (chunk.seq, orjson.dumps(data))


def end_event(session_id: str, last_seq: int, reason: str) -> bytes:
    data = orjson.dumps({"session_id": session_id, "last_seq": last_seq, "reason": reason})
    return b"event: end\ndata: %s\n\n" % data


async def stream_session(request: web.Request) -> web.StreamResponse:
    ctx, settings, closing = request.app[CTX], request.app[SETTINGS], request.app[CLOSING]
    record = await _get_record(request)
    last_id = _parse_last_event_id(request)
    subject = ctx.subjects.chunks(record.id)

    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    await resp.write(b"retry: 2000\n\n")
    if record.state is SessionState.TERMINATED and record.last_seq <= last_id:
        await resp.write(end_event(record.id, record.last_seq, "closed"))
        return resp

    sub = await ctx.js.subscribe(
        subject,
        ordered_consumer=True,
        deliver_policy=js_api.DeliverPolicy.ALL,
        inactive_threshold=60.0,
    )
    sent = last_id
    idle_s = 0.0
    quiet_polls = 0  # consecutive polls with nothing delivered
    poll_s = min(1.0, settings.sse_keepalive_s)
    try:
        while not closing.is_set():
            try:
                msg = await sub.next_msg(timeout=poll_s)
            except NatsTimeout:
                quiet_polls += 1
                idle_s += poll_s
                if idle_s >= settings.sse_keepalive_s:
                    await resp.write(b": keepalive\n\n")
                    idle_s = 0.0
                # The StreamEnd may be gone (retention) or never sent: the registry decides.
                if await _stream_is_over(ctx, record.id, sent, drained=quiet_polls >= 2):
                    await resp.write(end_event(record.id, sent, "closed"))
                    return resp
                continue
            idle_s = 0.0
            quiet_polls = 0
            item = decode_or_drop(msg.subject, msg.data, ChunkStreamMsg, log)
            if item is None:
                continue
            if isinstance(item, StreamEnd):
                await resp.write(end_event(record.id, item.last_seq, item.reason))
                return resp
            if item.seq <= sent:
                continue  # the client has it already, or a fenced worker's leftover
            await resp.write(chunk_event(item))
            sent = item.seq
        await resp.write(end_event(record.id, sent, "gateway_shutdown"))
    except ConnectionResetError:
        log.info("stream_client_gone", session_id=record.id, last_sent=sent)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return resp


async def _stream_is_over(ctx: ServiceContext, session_id: str, sent: int, drained: bool) -> bool:
    """True when the session is terminated (or gone) and nothing newer than ``sent`` will come:
    either the client has its last chunk, or the stream has been quiet long enough to have
    delivered every retained chunk (a terminated session produces no new ones)."""
    record = await ctx.registry.get_session(session_id)
    if record is None:
        return True
    return record.state is SessionState.TERMINATED and (record.last_seq <= sent or drained)


async def healthz(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    nats_ok = ctx.nc.is_connected
    try:
        redis_ok = bool(await asyncio.wait_for(ctx.redis.ping(), timeout=1.0))
    except Exception:  # noqa: BLE001 - any failure means not healthy
        redis_ok = False
    closing = request.app[CLOSING].is_set()
    ok = nats_ok and redis_ok and not closing
    body = {"status": "ok" if ok else "unavailable", "nats": nats_ok, "redis": redis_ok, "closing": closing}
    return json_response(body, status=200 if ok else 503)


async def index(request: web.Request) -> web.Response:
    return json_response({
        "service": "turboserve-gateway",
        "endpoints": [
            "POST /v1/sessions", "GET /v1/sessions/{id}", "DELETE /v1/sessions/{id}",
            "GET /v1/sessions/{id}/stream", "GET /healthz",
        ],
    })


def build_app(ctx: ServiceContext, settings: GatewaySettings) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware, auth_middleware], client_max_size=settings.max_body_bytes
    )
    app[CTX] = ctx
    app[SETTINGS] = settings
    app[CLOSING] = asyncio.Event()
    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/v1/sessions", create_session)
    app.router.add_get("/v1/sessions/{session_id}", get_session)
    app.router.add_delete("/v1/sessions/{session_id}", delete_session)
    app.router.add_get("/v1/sessions/{session_id}/stream", stream_session)
    return app

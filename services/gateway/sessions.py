"""The session routes: create, read, close, and steer (prompt, pause, resume)."""

from __future__ import annotations

import uuid

from aiohttp import web

from services.gateway import admission, bodies, control, errors
from services.gateway.auth import new_session_token, require_api_key
from services.gateway.state import GATEWAY_STATE, authorized_session, check_rate, json_response
from shared.logging import get_logger
from shared.wire import SessionEventKind, SessionInput

log = get_logger("turboserve.gateway")

CREATE_FIELDS = frozenset({"prompt", "seed", "input", "strength"})
PROMPT_FIELDS = frozenset({"prompt", "strength"})


async def create_session(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    key_name = require_api_key(gw.keys, request)
    if gw.closing.is_set():
        raise errors.Unavailable("gateway is shutting down; retry on another replica")
    await check_rate(gw, key_name)
    body = await bodies.read_object(request, CREATE_FIELDS)
    prompt = bodies.prompt_of(body, gw.settings.max_prompt_chars)
    seed = bodies.seed_of(body)
    source = bodies.input_of(body)
    strength = bodies.strength_of(body)
    if strength is not None and source is not SessionInput.VIDEO:
        raise errors.InvalidRequest(
            '\'strength\' is for a video session only ("input": "video")', field="strength"
        )
    await admission.check_pool(gw)
    session_id = uuid.uuid4().hex
    await admission.reserve_session(gw, key_name, session_id)
    token, token_hash = new_session_token()
    try:
        record = await gw.registry.create_session(
            session_id,
            prompt,
            seed,
            token_hash=token_hash,
            owner_key=key_name,
            input=source,
            strength=strength,
        )
        await gw.store.track(session_id)
    except BaseException:
        await gw.store.release_session(key_name, session_id)
        raise
    # The registry's pending set is the source of truth; the event only wakes the scheduler
    # at once (it also scans pending sessions on every tick), so a failed publish loses nothing.
    await control.publish_event(
        gw,
        session_id,
        SessionEventKind.CREATED,
        prompt=prompt,
        seed=seed,
        input=source,
        strength=strength,
        required=False,
    )
    log.info(
        "session_created",
        session_id=session_id,
        key=key_name,
        prompt_chars=len(prompt),
        input=str(source),
    )
    return json_response(
        gw.session_body(record, token=token),
        status=201,
        headers={"Location": f"/v1/sessions/{session_id}"},
    )


async def get_session(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    record, _ = await authorized_session(gw, request)
    activity = await gw.store.activity(record.id)
    viewers = await gw.store.viewers(record.id)
    return json_response(
        gw.session_body(record, activity=activity.value if activity else None, viewers=viewers)
    )


async def delete_session(request: web.Request) -> web.Response:
    """Close a session. Idempotent: a second (or concurrent) DELETE answers 200 with the record."""
    gw = request.app[GATEWAY_STATE]
    record, _ = await authorized_session(gw, request)
    record = await control.close(gw, record)
    return json_response(gw.session_body(record))


async def change_session_prompt(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    record, _ = await authorized_session(gw, request)
    body = await bodies.read_object(request, PROMPT_FIELDS)
    prompt, strength = bodies.steering_of(body, record, gw.settings.max_prompt_chars)
    answer = await control.change_prompt(gw, record, prompt, strength)
    extra = {} if strength is None else {"strength": strength}
    return json_response(
        {"id": record.id, "prompt": prompt, **extra, **answer.body("prompt change")},
        status=answer.status,
    )


async def pause_session(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    record, _ = await authorized_session(gw, request)
    answer = await control.pause(gw, record)
    return json_response(
        {"id": record.id, "activity": "paused", **answer.body("pause")}, status=answer.status
    )


async def resume_session(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_STATE]
    record, _ = await authorized_session(gw, request)
    answer = await control.resume(gw, record)
    return json_response(
        {"id": record.id, "activity": "active", **answer.body("resume")}, status=answer.status
    )

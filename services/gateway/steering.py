"""Controls that arrive on a live connection (the WebSocket, the WebRTC data channel): parsed,
applied one at a time and answered with the same ``ack`` and ``error`` messages on both.

A control is a JSON object ``{"type": "prompt" | "pause" | "resume" | "close", "id"?: any, ...}``
(a prompt's ``prompt`` and, for a video session, ``strength``, either or both);
it means exactly what ``POST .../prompt``, ``.../pause``, ``.../resume`` and ``DELETE`` mean
(:mod:`control` does the work). The answer echoes ``id``: ``{"type": "ack", "control", "id",
"confirmed", "next_seq"}`` (a close's also ``state`` and ``last_seq``, its ``next_seq`` null),
or ``{"type": "error", "control", "id", "error": {"code", "message", ...}}``.
"""

from __future__ import annotations

from typing import Any

import orjson

from services.gateway import bodies, control, errors
from services.gateway.state import Gateway, check_rate, load_session
from shared.registry import SessionRecord

CONTROLS = frozenset({"prompt", "pause", "resume", "close"})
# Controls a connection may have waiting to be applied; the WebSocket stops reading beyond it,
# the data channel answers the next one with an error.
CONTROLS_IN_FLIGHT = 8


def error_message(kind: str | None, ident: Any, exc: errors.ApiError) -> dict[str, Any]:
    return {"type": "error", "control": kind, "id": ident, "error": exc.body()}


class ControlRefused(Exception):
    """A message that is no control; ``message`` is the error to send back."""

    def __init__(self, kind: str | None, ident: Any, error: errors.ApiError) -> None:
        super().__init__(error.message)
        self.message = error_message(kind, ident, error)


def parse_control(data: str | bytes) -> dict[str, Any]:
    """The control a text message holds; :class:`ControlRefused` when it holds none."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ControlRefused(None, None, errors.InvalidJson(f"not JSON: {exc}")) from None
    if not isinstance(body, dict) or body.get("type") not in CONTROLS:
        kind = body.get("type") if isinstance(body, dict) else None
        ident = body.get("id") if isinstance(body, dict) else None
        raise ControlRefused(
            None,
            ident,
            errors.InvalidRequest(
                f"a control is a JSON object with 'type' one of {', '.join(sorted(CONTROLS))}",
                type=kind,
            ),
        )
    return body


async def answer(
    gw: Gateway, record: SessionRecord, operator: bool, body: dict[str, Any]
) -> dict[str, Any]:
    """Apply one parsed control to the session (as it is now in the registry); the ``ack`` or
    ``error`` message to send back."""
    kind, ident = body["type"], body.get("id")
    try:
        if not operator:
            await check_rate(gw, record.owner_key)
        current = await load_session(gw, record.id)
        result = await _apply(gw, current, kind, body)
    except errors.ApiError as exc:
        gw.metrics.refusals.labels(exc.code).inc()
        return error_message(kind, ident, exc)
    return {"type": "ack", "control": kind, "id": ident, **result}


async def _apply(
    gw: Gateway, record: SessionRecord, kind: str, body: dict[str, Any]
) -> dict[str, Any]:
    if kind == "prompt":
        unknown = sorted(set(body) - {"type", "id", "prompt", "strength"})
        if unknown:
            raise errors.InvalidRequest(f"unknown field(s): {', '.join(unknown)}", fields=unknown)
        prompt, strength = bodies.steering_of(body, record, gw.settings.max_prompt_chars)
        answer = await control.change_prompt(gw, record, prompt, strength)
        return {
            "prompt": prompt,
            **({} if strength is None else {"strength": strength}),
            **answer.body("prompt change"),
        }
    if kind == "pause":
        return (await control.pause(gw, record)).body("pause")
    if kind == "resume":
        return (await control.resume(gw, record)).body("resume")
    closed = await control.close(gw, record)
    return {
        "confirmed": True,
        "next_seq": None,
        "state": str(closed.state),
        "last_seq": closed.last_seq,
    }

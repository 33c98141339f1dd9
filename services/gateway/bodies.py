"""Request bodies: JSON objects with known fields, each value checked (type: 400, range: 422)."""

from __future__ import annotations

import secrets
from typing import Any

import orjson
from aiohttp import web

from services.gateway import errors
from shared.registry import SessionRecord
from shared.wire import SessionInput

SEED_LIMIT = 2**31


async def read_object(request: web.Request, allowed: frozenset[str]) -> dict[str, Any]:
    # The body is parsed as JSON whatever the Content-Type says (curl -d sends a form type by
    # default); what is not JSON gets a 400 with code invalid_json.
    raw = await request.read()
    return parse_object(raw, allowed)


def parse_object(raw: bytes | str, allowed: frozenset[str]) -> dict[str, Any]:
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as exc:
        raise errors.InvalidJson(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise errors.InvalidJson("body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise errors.InvalidRequest(f"unknown field(s): {', '.join(unknown)}", fields=unknown)
    return body


def prompt_of(body: dict[str, Any], limit: int) -> str:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise errors.InvalidRequest("'prompt' must be a non-empty string", field="prompt")
    if len(prompt) > limit:
        raise errors.PromptTooLong(len(prompt), limit)
    return prompt


def seed_of(body: dict[str, Any]) -> int:
    seed = body.get("seed")
    if seed is None:
        return secrets.randbits(31)
    if isinstance(seed, float) and seed.is_integer() and abs(seed) >= 2**63:
        # orjson reads an integer beyond 64 bits as a float: it is an integer, out of range.
        raise errors.OutOfRange(
            f"'seed' must be in [0, {SEED_LIMIT})", field="seed", minimum=0, maximum=SEED_LIMIT - 1
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise errors.InvalidRequest("'seed' must be an integer", field="seed")
    if not 0 <= seed < SEED_LIMIT:
        raise errors.OutOfRange(
            f"'seed' must be in [0, {SEED_LIMIT})",
            field="seed",
            value=seed,
            minimum=0,
            maximum=SEED_LIMIT - 1,
        )
    return seed


def input_of(body: dict[str, Any]) -> SessionInput:
    """What a new session generates from: ``"text"`` (the default) or ``"video"``."""
    value = body.get("input", SessionInput.TEXT.value)
    try:
        return SessionInput(value)
    except ValueError:
        allowed = ", ".join(repr(i.value) for i in SessionInput)
        raise errors.InvalidRequest(
            f"'input' must be one of {allowed}", field="input", value=value
        ) from None


def strength_of(body: dict[str, Any]) -> float | None:
    """A video session's strength, 0-1 (None: not given)."""
    value = body.get("strength")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise errors.InvalidRequest("'strength' must be a number", field="strength")
    if not 0.0 <= value <= 1.0:
        raise errors.OutOfRange(
            "'strength' must be in [0, 1]", field="strength", value=value, minimum=0, maximum=1
        )
    return float(value)


def steering_of(
    body: dict[str, Any], record: SessionRecord, limit: int
) -> tuple[str, float | None]:
    """A prompt change's prompt and strength: with a strength the prompt may be left out
    (the session's own is kept)."""
    strength = strength_of(body)
    if strength is not None and "prompt" not in body:
        return record.prompt, strength
    return prompt_of(body, limit), strength


STREAM_FROM = ("live", "start")


def start_of(request: web.Request, newest_seq: int) -> int:
    """The seq a new stream starts after. ``Last-Event-ID`` (header, or ``last_event_id`` in
    the query) resumes after that seq. Without it the stream starts at the live edge: the
    session's newest chunk (``newest_seq``, -1 when it has none yet), then what follows; a
    client that wants the backlog the chunk stream still holds asks ``?from=start``."""
    start = request.query.get("from", "live")
    if start not in STREAM_FROM:
        raise errors.InvalidRequest(
            f"'from' must be one of {', '.join(STREAM_FROM)}", field="from", value=start
        )
    if request.headers.get("Last-Event-ID") or request.query.get("last_event_id"):
        return last_seq_of(request)
    return -1 if start == "start" else max(-1, newest_seq - 1)


def last_seq_of(request: web.Request) -> int:
    """The seq the client has (``Last-Event-ID`` header or ``last_event_id`` query); -1: none."""
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        raise errors.InvalidRequest(
            "Last-Event-ID must be an integer chunk seq", value=raw
        ) from None
    if value < -1:
        raise errors.OutOfRange("Last-Event-ID must be >= -1", value=value, minimum=-1)
    return value

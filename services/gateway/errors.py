"""HTTP errors as JSON with a stable ``code`` (clients switch on the code, never the message).

``{"error": {"code", "message", "retryable", "details"?}}``; a 429 also carries
``Retry-After`` (whole seconds) and ``details.retry_after_s``.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web


class ApiError(Exception):
    status = 500
    code = "internal"
    retryable = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.details:
            body["details"] = self.details
        return body

    def headers(self) -> dict[str, str]:
        return {}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=orjson.dumps({"error": self.body()}),
            content_type="application/json",
            headers=self.headers(),
        )


class InvalidJson(ApiError):
    status, code = 400, "invalid_json"


class InvalidRequest(ApiError):
    status, code = 400, "invalid_request"


class PromptTooLong(ApiError):
    status, code = 400, "prompt_too_long"

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(
            f"prompt is {length} characters; the limit is {limit}", length=length, limit=limit
        )


class Unauthorized(ApiError):
    """No credential, or one that is no key at all."""

    status, code = 401, "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="turboserve"'}


class Forbidden(ApiError):
    """A valid credential that does not grant this: another session's token, an API key on an
    operator route."""

    status, code = 403, "forbidden"


class SessionNotFoundError(ApiError):
    status, code = 404, "session_not_found"


class RouteNotFound(ApiError):
    status, code = 404, "not_found"


class MethodNotAllowed(ApiError):
    status, code = 405, "method_not_allowed"

    def __init__(self, message: str, allowed: list[str]) -> None:
        super().__init__(message, allowed=allowed)
        self.allowed = allowed

    def headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allowed)}


class SessionClosed(ApiError):
    status, code = 409, "session_closed"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class FrameTooLarge(ApiError):
    """An input frame over ``TURBOSERVE_MAX_FRAME_BYTES``."""

    status, code = 413, "frame_too_large"


class InvalidFrame(ApiError):
    """An input frame that is not a JPEG image."""

    status, code = 400, "invalid_frame"


class NotVideoSession(ApiError):
    """Input frames or a strength for a text-to-video session."""

    status, code = 409, "not_video_session"


class OutOfRange(ApiError):
    """A value of the right type outside its range."""

    status, code = 422, "out_of_range"


class TooManyRequests(ApiError):
    status, retryable = 429, True

    def __init__(self, message: str, retry_after_s: float, **details: Any) -> None:
        super().__init__(message, retry_after_s=round(retry_after_s, 3), **details)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class RateLimited(TooManyRequests):
    code = "rate_limited"


class TooManySessions(TooManyRequests):
    code = "too_many_sessions"


class PoolFull(TooManyRequests):
    code = "pool_full"


class Unavailable(ApiError):
    status, code, retryable = 503, "unavailable", True

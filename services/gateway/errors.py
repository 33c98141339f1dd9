"""HTTP errors as JSON with a stable ``code`` (clients switch on the code, never the message)."""

from __future__ import annotations

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

    def response(self) -> web.Response:
        body: dict[str, Any] = {"code": self.code, "message": self.message, "retryable": self.retryable}
        if self.details:
            body["details"] = self.details
        return web.Response(
            status=self.status, body=orjson.dumps({"error": body}), content_type="application/json"
        )


class InvalidJson(ApiError):
    status, code = 400, "invalid_json"


class InvalidRequest(ApiError):
    status, code = 400, "invalid_request"


class PromptTooLong(ApiError):
    status, code = 400, "prompt_too_long"

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"prompt is {length} characters; the limit is {limit}", length=length, limit=limit)


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class SessionNotFound(ApiError):
    status, code = 404, "session_not_found"


class RouteNotFound(ApiError):
    status, code = 404, "not_found"


class MethodNotAllowed(ApiError):
    status, code = 405, "method_not_allowed"


class SessionClosed(ApiError):
    status, code = 409, "session_closed"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class Unavailable(ApiError):
    status, code, retryable = 503, "unavailable", True

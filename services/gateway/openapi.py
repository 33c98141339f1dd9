"""The OpenAPI 3 document of the gateway, served at ``/openapi.json``.

Written by hand next to the routes; a test checks that it names exactly the routes the app
serves, and schemathesis checks the app against it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.bodies import SEED_LIMIT
from services.gateway.state import GATEWAY_STATE, json_response
from services.gateway.webrtc import MAX_SDP_CHARS


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


def _limited(description: str) -> dict[str, Any]:
    response = _error(description)
    response["headers"] = {
        "Retry-After": {
            "description": "seconds to wait",
            "schema": {"type": "integer", "minimum": 1},
        }
    }
    return response


E400 = _error("invalid_json or invalid_request, or prompt_too_long")
E401 = _error("unauthorized: no credential, or an unknown one")
E403 = _error("forbidden: a credential that does not open this")
E404 = _error("session_not_found")
E409 = _error("session_closed")
E409_STEER = _error("session_closed, or not_video_session: a strength for a text session")
STRENGTH = {
    "type": "number",
    "minimum": 0,
    "maximum": 1,
    "nullable": True,
    "description": "a video session's strength: how much of the input is restyled (0 keeps "
    "it, 1 ignores it); none or null: the model's default (0.7)",
}
E413 = _error("payload_too_large")
E422 = _error("out_of_range")
E429 = _limited("rate_limited, too_many_sessions or pool_full")
E503 = _error("unavailable (retryable)")

SESSION_ID = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
TOKEN_QUERY = {
    "name": "token",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "the session token, for clients that cannot set headers",
}
SEQ = {"type": "integer", "minimum": -1}
LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "required": False,
    "schema": SEQ,
    "description": "resume after this chunk seq",
}
LAST_EVENT_QUERY = {
    "name": "last_event_id",
    "in": "query",
    "required": False,
    "schema": SEQ,
    "description": "as Last-Event-ID",
}
FROM_QUERY = {
    "name": "from",
    "in": "query",
    "required": False,
    "schema": {"type": "string", "enum": ["live", "start"], "default": "live"},
    "description": "without Last-Event-ID: start at the newest chunk (live) or at the "
    "oldest the chunk stream still holds (start)",
}
FORMAT_QUERY = {
    "name": "format",
    "in": "query",
    "required": False,
    "schema": {"type": "string", "enum": ["jpeg", "fmp4"], "default": "jpeg"},
    "description": "jpeg: a chunk is one base64 JPEG per frame (SSE `frames`; WebSocket: "
    "the JPEGs after the header, `frame_sizes`); fmp4: a chunk is one "
    "self-contained fragmented MP4, H.264, keyframe first (SSE "
    "`fragment`, base64; WebSocket: its bytes after the header), with "
    "`mime`, `start_s`, `duration_s`. Another value: 400 invalid_request",
}
SESSION_AUTH: list[dict[str, list[str]]] = [
    {"sessionToken": []},
    {"sessionTokenQuery": []},
    {"operatorKey": []},
]
SESSION_ERRORS = {"401": E401, "403": E403, "404": E404, "429": E429}

# From a created session to what can be done with it (its id and token): clients and tools that
# follow links (schemathesis's stateful phase) steer the session they created.
LINKS = {
    name: {
        "operationId": op_id,
        "parameters": {"session_id": "$response.body#/id", "token": "$response.body#/token"},
    }
    for name, op_id in (
        ("GetSession", "getSession"),
        ("ChangePrompt", "changePrompt"),
        ("PauseSession", "pauseSession"),
        ("ResumeSession", "resumeSession"),
        ("CloseSession", "closeSession"),
    )
}


def schemas(max_prompt_chars: int) -> dict[str, Any]:
    # A prompt has a character that is not white space, and at most the configured length.
    prompt = {"type": "string", "minLength": 1, "maxLength": max_prompt_chars, "pattern": r"\S"}
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["code", "message", "retryable"],
                    "properties": {
                        "code": {"type": "string"},
                        "message": {"type": "string"},
                        "retryable": {"type": "boolean"},
                        "details": {"type": "object"},
                    },
                }
            },
        },
        "CreateSession": {
            "type": "object",
            "required": ["prompt"],
            "additionalProperties": False,
            "properties": {
                "prompt": prompt,
                "seed": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": SEED_LIMIT - 1,
                    "nullable": True,
                    "description": "none or null: a random seed",
                },
                "input": {
                    "type": "string",
                    "enum": ["text", "video"],
                    "default": "text",
                    "description": "video: a video-to-video session, restyling the frames its "
                    "client sends (WebSocket binary messages or a WebRTC track)",
                },
                "strength": STRENGTH,
            },
        },
        "Session": {
            "type": "object",
            "required": [
                "id",
                "state",
                "epoch",
                "prompt",
                "seed",
                "last_seq",
                "stream_url",
                "ws_url",
            ],
            "properties": {
                "id": {"type": "string"},
                "state": {
                    "type": "string",
                    "enum": ["pending", "executing", "suspended", "migrating", "terminated"],
                },
                "worker_id": {"type": "string", "nullable": True},
                "epoch": {"type": "integer"},
                "prompt": {"type": "string"},
                "seed": {"type": "integer"},
                "input": {"type": "string", "enum": ["text", "video"]},
                "strength": {
                    "type": "number",
                    "nullable": True,
                    "description": "a video session's strength (the default when none was "
                    "given); null for a text session",
                },
                "last_seq": {"type": "integer"},
                "created_at": {"type": "number"},
                "updated_at": {"type": "number"},
                "stream_url": {"type": "string"},
                "ws_url": {"type": "string"},
                "token": {
                    "type": "string",
                    "description": "only in the answer to POST /v1/sessions",
                },
                "activity": {
                    "type": "string",
                    "enum": ["active", "idle", "paused"],
                    "nullable": True,
                },
                "viewers": {"type": "integer"},
            },
        },
        "Prompt": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"prompt": prompt, "strength": STRENGTH},
            "anyOf": [{"required": ["prompt"]}, {"required": ["strength"]}],
            "description": "a new prompt, a video session's new strength, or both; with a "
            "strength alone the prompt is kept",
        },
        "ControlAnswer": {
            "type": "object",
            "required": ["id", "confirmed", "next_seq"],
            "properties": {
                "id": {"type": "string"},
                "confirmed": {
                    "type": "boolean",
                    "description": "the worker confirmed it (200); else accepted (202)",
                },
                "next_seq": {
                    "type": "integer",
                    "nullable": True,
                    "description": "the first chunk the change holds for",
                },
                "prompt": {"type": "string"},
                "strength": {"type": "number"},
                "activity": {"type": "string", "enum": ["active", "paused"]},
                "message": {"type": "string"},
            },
        },
        "WebRtcOffer": {
            "type": "object",
            "required": ["sdp"],
            "additionalProperties": False,
            "properties": {
                "type": {"type": "string", "enum": ["offer"], "default": "offer"},
                "sdp": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_SDP_CHARS,
                    "description": "an SDP offer that receives video (a recvonly video "
                    "transceiver) and, to steer, opens a data channel",
                },
            },
        },
        "WebRtcAnswer": {
            "type": "object",
            "required": ["type", "sdp", "session_id"],
            "properties": {
                "type": {"type": "string", "enum": ["answer"]},
                "sdp": {"type": "string"},
                "session_id": {"type": "string"},
                "video": {
                    "type": "object",
                    "properties": {
                        "codec": {
                            "type": "string",
                            "nullable": True,
                            "description": "video/H264 (preferred) or video/VP8",
                        },
                        "pass_through": {
                            "type": "boolean",
                            "description": "the worker's H.264 goes out as "
                            "it came; else re-encoded",
                        },
                    },
                },
                "camera": {
                    "type": "boolean",
                    "description": "the gateway takes the video the offer sends (a video "
                    "session's peer, on a sendrecv transceiver) as the session's input",
                },
            },
        },
        "Cluster": {
            "type": "object",
            "required": ["workers", "events", "latency", "pending"],
            "properties": {
                "at": {"type": "number"},
                "workers": {"type": "array", "items": {"type": "object"}},
                "target": {"type": "number", "nullable": True},
                "pool": {"type": "object", "nullable": True},
                "scheduler": {"type": "object", "nullable": True},
                "pending": {"type": "array", "items": {"type": "string"}},
                "events": {"type": "array", "items": {"type": "object"}},
                "latency": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "number"}},
                },
            },
        },
        "Probe": {
            "type": "object",
            "required": ["status"],
            "properties": {
                "status": {"type": "string"},
                "nats": {"type": "boolean"},
                "redis": {"type": "boolean"},
                "closing": {"type": "boolean"},
                "workers_ready": {
                    "type": "integer",
                    "description": "workers that can take a session",
                },
                "needs_worker": {
                    "type": "boolean",
                    "description": "ready only once a worker is (not with a pool that "
                    "starts at zero: TURBOSERVE_READY_WITHOUT_WORKERS)",
                },
            },
        },
    }


def _session_op(op_id: str, summary: str, ok: dict[str, Any], **extra: Any) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": op_id,
        "summary": summary,
        "parameters": [SESSION_ID, TOKEN_QUERY],
        "security": SESSION_AUTH,
        "responses": {**ok, **SESSION_ERRORS},
    }
    for key, value in extra.items():
        if key == "parameters":
            op["parameters"] = [*op["parameters"], *value]
        elif key == "responses":
            op["responses"] = {**op["responses"], **value}
        else:
            op[key] = value
    return op


def _control(op_id: str, summary: str, body: bool = False) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "responses": {
            "202": _json(_ref("ControlAnswer"), "accepted, not yet confirmed"),
            "409": E409,
            "503": E503,
        }
    }
    if body:
        extra["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref("Prompt")}},
        }
        extra["responses"] |= {"400": E400, "409": E409_STEER, "413": E413, "422": E422}
    return _session_op(
        op_id, summary, {"200": _json(_ref("ControlAnswer"), "done, from next_seq on")}, **extra
    )


def _page(op_id: str, summary: str, content_type: str = "text/html") -> dict[str, Any]:
    return {
        "get": {
            "operationId": op_id,
            "summary": summary,
            "security": [],
            "responses": {
                "200": {
                    "description": summary,
                    "content": {content_type: {"schema": {"type": "string"}}},
                }
            },
        }
    }


def document(max_prompt_chars: int) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "TurboServe gateway",
            "version": "1",
            "description": "Interactive streaming video sessions: create, watch (SSE, "
            "WebSocket or WebRTC), steer, close; the cluster view for operators.",
        },
        "components": {
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "an API key"},
                "sessionToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the token POST /v1/sessions returned",
                },
                "sessionTokenQuery": {"type": "apiKey", "in": "query", "name": "token"},
                "operatorKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the operator key",
                },
            },
            "schemas": schemas(max_prompt_chars),
        },
        "paths": {
            "/": _page("playground", "the playground"),
            "/dashboard": _page("dashboard", "the operator dashboard (asks for the operator key)"),
            "/static/{name}": {
                "get": {
                    "operationId": "staticFile",
                    "summary": "a file of the pages",
                    "security": [],
                    "parameters": [
                        {
                            "name": "name",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {
                            "description": "the file",
                            "content": {
                                "text/javascript": {"schema": {"type": "string"}},
                                "text/css": {"schema": {"type": "string"}},
                            },
                        },
                        "404": _error("not_found"),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "this document",
                    "security": [],
                    "responses": {"200": _json({"type": "object"}, "OpenAPI 3")},
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "healthz",
                    "summary": "liveness",
                    "security": [],
                    "responses": {"200": _json(_ref("Probe"), "the process serves")},
                }
            },
            "/readyz": {
                "get": {
                    "operationId": "readyz",
                    "summary": "readiness",
                    "security": [],
                    "responses": {
                        "200": _json(_ref("Probe"), "ready"),
                        "503": _json(_ref("Probe"), "not ready"),
                    },
                }
            },
            "/metrics": _page("metrics", "Prometheus metrics", "text/plain"),
            "/v1/sessions": {
                "post": {
                    "operationId": "createSession",
                    "summary": "create a session",
                    "security": [{"apiKey": []}],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("CreateSession")}},
                    },
                    "responses": {
                        "201": {
                            **_json(_ref("Session"), "the session, with its token"),
                            "links": LINKS,
                        },
                        "400": E400,
                        "401": E401,
                        "403": E403,
                        "413": E413,
                        "422": E422,
                        "429": E429,
                        "503": E503,
                    },
                }
            },
            "/v1/sessions/{session_id}": {
                "get": _session_op(
                    "getSession", "the session", {"200": _json(_ref("Session"), "the session")}
                ),
                "delete": _session_op(
                    "closeSession",
                    "close the session (idempotent)",
                    {"200": _json(_ref("Session"), "the closed session")},
                ),
            },
            "/v1/sessions/{session_id}/stream": {
                "get": _session_op(
                    "streamSession",
                    "the session's chunks and state changes as Server-Sent Events",
                    {
                        "200": {
                            "description": "event stream: chunk, state, lag, end",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        }
                    },
                    parameters=[LAST_EVENT_ID, LAST_EVENT_QUERY, FROM_QUERY, FORMAT_QUERY],
                    responses={"400": E400, "422": E422},
                )
            },
            "/v1/sessions/{session_id}/ws": {
                "get": _session_op(
                    "sessionSocket",
                    "the session over a WebSocket: chunks and state out, controls in, and a "
                    "video session's camera frames in (binary: a 4-byte big-endian header "
                    'length, the JSON header {"type": "frame", "seq", "captured_at"}, one JPEG)',
                    {"101": {"description": "switching to the WebSocket protocol"}},
                    parameters=[LAST_EVENT_QUERY, FROM_QUERY, FORMAT_QUERY],
                    responses={
                        "400": _error(
                            "invalid_request: not a WebSocket upgrade, or a bad 'from' or 'format'"
                        ),
                        "422": E422,
                        "503": E503,
                    },
                )
            },
            "/v1/sessions/{session_id}/webrtc": {
                "post": _session_op(
                    "sessionWebRtc",
                    "the session as a WebRTC peer: an SDP offer in, the answer out; "
                    "chunks on the video track, controls on a data channel (as on the WebSocket)",
                    {
                        "200": _json(
                            _ref("WebRtcAnswer"), "the SDP answer (host ICE candidates only)"
                        )
                    },
                    requestBody={
                        "required": True,
                        "content": {"application/json": {"schema": _ref("WebRtcOffer")}},
                    },
                    responses={
                        "400": _error(
                            "invalid_json, invalid_request, or invalid_offer: no SDP "
                            "offer aiortc can answer, or one without video"
                        ),
                        "409": E409,
                        "413": E413,
                        "503": E503,
                    },
                )
            },
            "/v1/sessions/{session_id}/prompt": {
                "post": _control(
                    "changePrompt", "change the prompt from the next chunk boundary", body=True
                )
            },
            "/v1/sessions/{session_id}/pause": {
                "post": _control(
                    "pauseSession",
                    "pause: the session goes idle, its state suspended to host memory",
                )
            },
            "/v1/sessions/{session_id}/resume": {
                "post": _control("resumeSession", "resume a paused session")
            },
            "/v1/cluster": {
                "get": {
                    "operationId": "cluster",
                    "summary": "workers, load against the target, migrations, scale events, latency",
                    "security": [{"operatorKey": []}],
                    "responses": {
                        "200": _json(_ref("Cluster"), "the cluster"),
                        "401": E401,
                        "403": E403,
                    },
                }
            },
        },
    }


async def openapi_json(request: web.Request) -> web.Response:
    return json_response(document(request.app[GATEWAY_STATE].settings.max_prompt_chars))

"""Keys, tokens and every error code, against the gateway in-process on the real NATS/Redis."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import pytest

from services.gateway.openapi import document
from shared.registry import WorkerRecord
from shared.wire import WorkerStatus
from tests.gateway.conftest import API_KEY, OPERATOR_KEY, OTHER_KEY, bearer, create, run_gateway

pytestmark = pytest.mark.integration

SESSION_ROUTES = [
    ("GET", ""),
    ("DELETE", ""),
    ("POST", "/prompt"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/stream"),
    ("GET", "/ws"),
]


async def test_create_answers_token_and_urls_and_stores_only_a_digest(http, gw, redis_client):
    body = await create(http, prompt="a lighthouse at dusk", seed=5)
    sid, token = body["id"], body["token"]
    assert body["state"] == "pending" and body["seed"] == 5 and len(token) >= 40
    assert body["stream_url"] == f"/v1/sessions/{sid}/stream"
    assert body["ws_url"] == f"/v1/sessions/{sid}/ws"
    record = await gw.ctx.registry.get_session(sid)
    assert record.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert record.owner_key == "alice"
    ns = gw.gateway.settings.redis_namespace
    async for key in redis_client.scan_iter(match=f"{ns}:*"):
        kind = await redis_client.type(key)
        values = {
            b"hash": lambda k: redis_client.hvals(k),
            b"string": lambda k: redis_client.mget([k]),
            b"set": lambda k: redis_client.smembers(k),
            b"zset": lambda k: redis_client.zrange(k, 0, -1),
            b"list": lambda k: redis_client.lrange(k, 0, -1),
        }[kind](key)
        assert not any(token.encode() in (v or b"") for v in await values), key


async def test_creating_needs_an_api_key(http):
    resp = await http.post("/v1/sessions", json={"prompt": "p"})
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "unauthorized"
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    resp = await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer("nope"))
    assert resp.status == 401
    resp = await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer(OPERATOR_KEY))
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "forbidden"
    # both configured keys work, each counted under its own name
    assert (await create(http, key=OTHER_KEY))["id"]


@pytest.mark.parametrize(("method", "suffix"), SESSION_ROUTES)
async def test_a_client_can_never_touch_another_clients_session(http, gw, method, suffix):
    mine = await create(http)
    theirs = await create(http, key=OTHER_KEY)
    path = f"/v1/sessions/{mine['id']}{suffix}"
    for headers, status in (
        ({}, 401),
        (bearer(theirs["token"]), 403),
        (bearer(API_KEY), 403),
        (bearer(OTHER_KEY), 403),
        (bearer("x" * 43), 403),
    ):
        resp = await http.request(method, path, headers=headers, json={"prompt": "steer"})
        assert resp.status == status, (headers, await resp.text())
        assert (await resp.json())["error"]["code"] == (
            "unauthorized" if status == 401 else "forbidden"
        )
    # the same with the token in the query string
    resp = await http.request(method, path, params={"token": theirs["token"]}, json={"prompt": "x"})
    assert resp.status == 403
    record = await gw.ctx.registry.get_session(mine["id"])
    assert record.state.value == "pending" and record.prompt == "a fox"  # untouched


async def test_own_token_header_or_query_and_operator_key_open_a_session(http):
    s = await create(http)
    for kwargs in (
        {"headers": bearer(s["token"])},
        {"params": {"token": s["token"]}},
        {"headers": bearer(OPERATOR_KEY)},
    ):
        resp = await http.get(f"/v1/sessions/{s['id']}", **kwargs)
        assert resp.status == 200
        body = await resp.json()
        assert body["id"] == s["id"] and "token" not in body and body["activity"] == "active"


async def test_bad_bodies_get_stable_codes(http):
    s = await create(http)
    post = lambda path, **kw: http.post(path, headers=bearer(API_KEY), **kw)  # noqa: E731
    cases = [
        (post("/v1/sessions", data=b"{not json"), 400, "invalid_json"),
        (post("/v1/sessions", json=["a list"]), 400, "invalid_json"),
        (post("/v1/sessions", json={"prompt": ""}), 400, "invalid_request"),
        (post("/v1/sessions", json={"prompt": "p", "colour": "red"}), 400, "invalid_request"),
        (post("/v1/sessions", json={"prompt": "p", "seed": "7"}), 400, "invalid_request"),
        (post("/v1/sessions", json={"prompt": "x" * 2001}), 400, "prompt_too_long"),
        (post("/v1/sessions", json={"prompt": "p", "seed": -1}), 422, "out_of_range"),
        (post("/v1/sessions", json={"prompt": "p", "seed": 2**31}), 422, "out_of_range"),
        (
            post("/v1/sessions", data=b'{"prompt": "p", "seed": 99999999999999999999999999}'),
            422,
            "out_of_range",
        ),
        (
            post("/v1/sessions", data=b'{"prompt": "p", "seed": -18446744073709551617}'),
            422,
            "out_of_range",
        ),
        (post("/v1/sessions", json={"prompt": "p", "seed": 7.5}), 400, "invalid_request"),
        (post("/v1/sessions", data=b"x" * 70_000), 413, "payload_too_large"),
        (
            http.post(
                f"/v1/sessions/{s['id']}/prompt", json={"prompt": 3}, headers=bearer(s["token"])
            ),
            400,
            "invalid_request",
        ),
        (
            http.get(
                f"/v1/sessions/{s['id']}/stream",
                headers={**bearer(s["token"]), "Last-Event-ID": "x"},
            ),
            400,
            "invalid_request",
        ),
        (
            http.get(
                f"/v1/sessions/{s['id']}/stream",
                headers={**bearer(s["token"]), "Last-Event-ID": "-3"},
            ),
            422,
            "out_of_range",
        ),
        (
            http.get(f"/v1/sessions/{s['id']}/ws", headers=bearer(s["token"])),
            400,
            "invalid_request",
        ),
        (
            http.get("/v1/sessions/0123456789abcdef", headers=bearer(OPERATOR_KEY)),
            404,
            "session_not_found",
        ),
        (
            http.get("/v1/sessions/bad.id/stream", headers=bearer(OPERATOR_KEY)),
            404,
            "session_not_found",
        ),
        (http.get("/v1/nothing"), 404, "not_found"),
        (http.get("/static/nothing.js"), 404, "not_found"),
        (http.put("/v1/sessions"), 405, "method_not_allowed"),
    ]
    for request, status, code in cases:
        resp = await request
        body = await resp.json()
        assert (resp.status, body["error"]["code"]) == (status, code), body
        assert isinstance(body["error"]["message"], str) and body["error"]["retryable"] is False
    body = await (await post("/v1/sessions", json={"prompt": "x" * 2001})).json()
    assert body["error"]["details"] == {"length": 2001, "limit": 2000}


@pytest.mark.parametrize(
    ("method", "suffix"), [("POST", "/prompt"), ("POST", "/pause"), ("POST", "/resume")]
)
async def test_steering_a_closed_session_is_a_conflict(http, method, suffix):
    s = await create(http)
    assert (await http.delete(f"/v1/sessions/{s['id']}", headers=bearer(s["token"]))).status == 200
    resp = await http.request(
        method,
        f"/v1/sessions/{s['id']}{suffix}",
        headers=bearer(s["token"]),
        json={"prompt": "too late"},
    )
    body = await resp.json()
    assert resp.status == 409 and body["error"]["code"] == "session_closed"


async def test_rate_limit_per_key_answers_429_with_retry_after(gw_env, nats_client, redis_client):
    import aiohttp

    async with (
        run_gateway(gw_env, rate_per_key_s=0.5, rate_burst=2) as g,
        aiohttp.ClientSession(g.url) as http,
    ):
        assert (await create(http))["id"]
        assert (await create(http))["id"]
        resp = await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer(API_KEY))
        body = await resp.json()
        assert resp.status == 429 and body["error"]["code"] == "rate_limited"
        assert body["error"]["retryable"] is True
        assert 1 <= int(resp.headers["Retry-After"]) <= 3
        # another key has its own budget
        assert (await create(http, key=OTHER_KEY))["id"]


async def test_per_key_session_limit(gw_env, nats_client, redis_client):
    import aiohttp

    async with (
        run_gateway(gw_env, max_sessions_per_key=2) as g,
        aiohttp.ClientSession(g.url) as http,
    ):
        first = await create(http)
        await create(http)
        resp = await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer(API_KEY))
        body = await resp.json()
        assert resp.status == 429 and body["error"]["code"] == "too_many_sessions"
        assert body["error"]["details"]["limit"] == 2 and "Retry-After" in resp.headers
        assert (await create(http, key=OTHER_KEY))["id"]  # bob is not alice
        await http.delete(f"/v1/sessions/{first['id']}", headers=bearer(first["token"]))
        assert (await create(http))["id"]  # a closed session frees its place


async def test_per_key_limit_prunes_sessions_closed_behind_the_gateways_back(
    gw_env, nats_client, redis_client
):
    import aiohttp

    from shared.states import SessionState

    async with (
        run_gateway(gw_env, max_sessions_per_key=1) as g,
        aiohttp.ClientSession(g.url) as http,
    ):
        first = await create(http)
        await g.ctx.registry.transition(first["id"], SessionState.TERMINATED)
        assert (await create(http))["id"]


async def test_concurrent_deletes_are_idempotent(http, gw):
    s = await create(http)
    responses = await asyncio.gather(
        *(http.delete(f"/v1/sessions/{s['id']}", headers=bearer(s["token"])) for _ in range(4))
    )
    assert [r.status for r in responses] == [200] * 4
    assert {(await r.json())["state"] for r in responses} == {"terminated"}
    assert (await gw.ctx.registry.get_session(s["id"])).epoch == 1  # terminated exactly once
    assert await gw.store.activity(s["id"]) is None  # forgotten by the gateways


async def test_openapi_names_exactly_the_routes_served(http, gw):
    served = set()
    for route in gw.service._runner.app.router.routes():  # type: ignore[union-attr]
        if route.method in ("HEAD", "*"):
            continue
        served.add((route.method.lower(), route.resource.canonical))
    documented = {(m, p) for p, ops in document(2000)["paths"].items() for m in ops}
    assert served == documented
    body = await (await http.get("/openapi.json")).json()
    assert (
        body["openapi"].startswith("3.") and body["paths"].keys() == document(2000)["paths"].keys()
    )


async def test_probes(http, gw):
    assert (await http.get("/healthz")).status == 200
    # Up, but nothing can serve a session yet: not ready.
    resp = await http.get("/readyz")
    assert resp.status == 503 and (await resp.json()) == {
        "status": "unavailable",
        "nats": True,
        "redis": True,
        "closing": False,
        "workers_ready": 0,
        "needs_worker": True,
    }
    registry = gw.ctx.registry
    await registry.register_worker(WorkerRecord("w-booting", WorkerStatus.BOOTING, 4), ttl_s=30)
    await registry.register_worker(WorkerRecord("w-silent", WorkerStatus.READY, 4), ttl_s=0.05)
    await asyncio.sleep(0.2)  # its heartbeat lapses
    resp = await http.get("/readyz")
    assert resp.status == 503, await resp.text()  # booting, or ready but silent: not yet
    await registry.register_worker(WorkerRecord("w-ready", WorkerStatus.READY, 4), ttl_s=30)
    resp = await http.get("/readyz")
    assert resp.status == 200 and (await resp.json()) == {
        "status": "ok",
        "nats": True,
        "redis": True,
        "closing": False,
        "workers_ready": 1,
        "needs_worker": True,
    }
    gw.gateway.closing.set()
    resp = await http.get("/readyz")
    assert resp.status == 503 and (await resp.json())["closing"] is True
    resp = await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer(API_KEY))
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "unavailable"


async def test_the_operator_may_close_any_session(http, gw):
    s = await create(http)
    resp = await http.delete(f"/v1/sessions/{s['id']}", headers=bearer(OPERATOR_KEY))
    assert resp.status == 200 and (await resp.json())["state"] == "terminated"


async def test_secrets_are_never_logged(gw_env, nats_client, redis_client):
    import aiohttp
    import structlog

    with structlog.testing.capture_logs() as logs:
        async with run_gateway(gw_env) as g, aiohttp.ClientSession(g.url) as http:
            s = await create(http)
            await http.get(f"/v1/sessions/{s['id']}", headers=bearer(s["token"]))
            await http.get(f"/v1/sessions/{s['id']}", params={"token": OTHER_KEY})  # a wrong one
            await http.get("/v1/cluster", headers=bearer(API_KEY))
            await http.post("/v1/sessions", json={"prompt": "p"}, headers=bearer(OPERATOR_KEY))
            await http.delete(f"/v1/sessions/{s['id']}", headers=bearer(s["token"]))
            printed = str(g.gateway.settings)  # what the runner prints at start
    text = repr(logs) + printed
    assert any(e["event"] == "session_created" for e in logs)  # the logs were captured
    assert any(e["event"] == "session_closed" for e in logs)
    for secret in (API_KEY, OTHER_KEY, OPERATOR_KEY, s["token"]):
        assert secret not in text


async def test_a_pool_that_starts_at_zero_is_ready_without_workers(
    gw_env, nats_client, redis_client
):
    async with (
        run_gateway(gw_env, ready_without_workers=True) as gw,
        aiohttp.ClientSession(gw.url) as http,
    ):
        resp = await http.get("/readyz")
        body = await resp.json()
    assert resp.status == 200 and body["workers_ready"] == 0 and body["needs_worker"] is False

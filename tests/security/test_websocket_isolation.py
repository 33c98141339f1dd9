"""Through a real WebSocket, one client can neither read, steer nor close another's session
(the gateway in-process on the real NATS and Redis; a stand-in worker publishes chunks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from shared.wire import Subjects
from tests.gateway.conftest import (
    API_KEY,
    OPERATOR_KEY,
    OTHER_KEY,
    FakeWorker,
    bearer,
    create,
    run_gateway,
)

pytestmark = pytest.mark.integration


@pytest.fixture
async def http(infra, isolation, nats_client, redis_client) -> AsyncIterator[aiohttp.ClientSession]:
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
        "TURBOSERVE_API_KEYS": f"alice:{API_KEY},bob:{OTHER_KEY}",
        "TURBOSERVE_OPERATOR_KEY": OPERATOR_KEY,
        "TURBOSERVE_CONTROL_WAIT_S": "1",
    }
    async with run_gateway(env) as gw, aiohttp.ClientSession(gw.url) as client:
        client.gw = gw  # type: ignore[attr-defined]
        yield client


async def test_a_socket_never_opens_on_another_clients_session(http):
    mine = await create(http)
    theirs = await create(http, key=OTHER_KEY)
    path = f"/v1/sessions/{mine['id']}/ws"
    attempts = [
        ({}, {}, 401),
        (bearer(theirs["token"]), {}, 403),
        ({}, {"token": theirs["token"]}, 403),
        (bearer(API_KEY), {}, 403),
        (bearer(OTHER_KEY), {}, 403),
        (bearer(theirs["token"]), {"token": "x" * 43}, 403),
    ]
    for headers, params, status in attempts:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with http.ws_connect(path, headers=headers, params=params):
                pass
        assert refused.value.status == status, (headers, params)
    async with http.ws_connect(path, params={"token": mine["token"]}):
        pass  # its own token opens it


async def _next_text(ws: aiohttp.ClientWebSocketResponse, kind: str) -> dict:
    async with asyncio.timeout(15):
        while True:
            msg = await ws.receive()
            if msg.type is aiohttp.WSMsgType.TEXT:
                body = orjson.loads(msg.data)
                if body["type"] in (kind, "error"):
                    return body


async def test_a_socket_reads_and_steers_only_its_own_session(http, nats_client, isolation):
    gw = http.gw
    worker = FakeWorker(
        nats_client, Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"]), registry=gw.ctx.registry
    )
    mine = await create(http, prompt="mine")
    theirs = await create(http, key=OTHER_KEY, prompt="theirs")
    async with http.ws_connect(
        f"/v1/sessions/{theirs['id']}/ws", params={"token": theirs["token"]}
    ) as ws:
        # read: the chunks of the other session never reach this socket
        await worker.chunk(mine["id"], 0)
        await worker.chunk(theirs["id"], 0)
        async with asyncio.timeout(15):
            msg = await ws.receive()
            while msg.type is not aiohttp.WSMsgType.BINARY:
                msg = await ws.receive()
        header_len = int.from_bytes(msg.data[:4], "big")
        assert orjson.loads(msg.data[4 : 4 + header_len])["session_id"] == theirs["id"]
        # steer: a control naming another session is refused, not applied to it
        await ws.send_str(
            orjson.dumps(
                {"type": "prompt", "prompt": "hijack", "session_id": mine["id"], "id": 1}
            ).decode()
        )
        refused = await _next_text(ws, "ack")
        assert refused["type"] == "error" and refused["error"]["code"] == "invalid_request"
        # close: applies to this socket's own session only
        await ws.send_str(
            orjson.dumps({"type": "close", "session_id": mine["id"], "id": 2}).decode()
        )
        ack = await _next_text(ws, "ack")
        assert ack["type"] == "ack" and ack["state"] == "terminated"
    untouched = await gw.ctx.registry.get_session(mine["id"])
    assert untouched.state.value == "pending" and untouched.prompt == "mine"
    closed = await gw.ctx.registry.get_session(theirs["id"])
    assert closed.state.value == "terminated"

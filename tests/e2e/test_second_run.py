"""A second run of the mesh on the NATS and Redis an earlier run used, as `turboserve up` reuses
them: it settles the earlier run's sessions before its services start (nothing nobody watches
is placed; what a viewer comes back to still plays), and holds its floor of two workers with no
scale event though the earlier run's pool record says one. Whether the scheduler takes the lead
before the provisioner writes its own record is a race here; that the scheduler follows a record
that changes is held deterministically by ``tests/scheduler/live/test_scheduler_release.py``."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from shared.registry import PoolLimits, Registry
from shared.states import SessionState
from tests.e2e.test_mesh import read_sse
from tests.eventually import eventually
from tools.launcher import Mesh, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IDLE_AFTER_S = 2.0
CLOSE_AFTER_S = 30.0
HOLD_S = 60.0


def run_of(infra, isolation) -> Mesh:
    return Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=2,
        embedded="never",
        env={
            **isolation,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_CHUNK_PERIOD_S": "0.2",
            "TURBOSERVE_MAX_WORKERS": "3",
            "TURBOSERVE_IDLE_AFTER_S": str(IDLE_AFTER_S),
            "TURBOSERVE_CLOSE_AFTER_S": str(CLOSE_AFTER_S),
        },
        quiet=True,
    )


async def test_a_second_run_starts_clean_and_holds_its_floor(
    infra, isolation, redis_client, nats_client
):
    registry = Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    ns = isolation["TURBOSERVE_REDIS_NAMESPACE"]

    # 1. The earlier run: two sessions nobody watches, then it stops.
    first = run_of(infra, isolation)
    await asyncio.to_thread(first.start, 120)
    try:
        async with aiohttp.ClientSession(first.gateway_url) as http:
            sessions = []
            for prompt in ("an old lighthouse", "a slow river"):
                resp = await http.post("/v1/sessions", json={"prompt": prompt})
                assert resp.status == 201
                sessions.append(await resp.json())
    finally:
        await asyncio.to_thread(first.stop)
    old, recent = sessions
    # One of them was last watched long ago (past its lifetime); the other a few seconds ago.
    await redis_client.zadd(f"{ns}:gw:sessions", {old["id"]: time.time() - 1000}, xx=True)
    # The earlier run's pool record says one worker: the second run's provisioner writes two.
    await registry.set_pool_limits(PoolLimits(1, 3, "local"))
    await asyncio.sleep(IDLE_AFTER_S + 1)

    # 2. The second run: it says what it found and did, before any service starts.
    before = await registry.counters()
    second = run_of(infra, isolation)
    await asyncio.to_thread(second.start, 120)
    try:
        line = second.earlier_sessions or ""
        assert "found 2 from an earlier run" in line and "closed 1" in line, line
        assert "1 idle until watched again" in line, line
        record = await registry.get_session(old["id"])
        assert record is not None and record.state is SessionState.TERMINATED

        seen: set[str] = set()

        async def two_ready() -> bool:
            seen.update(w.id for w in await registry.workers() if w.alive)
            status = await registry.scheduler_status()
            return status is not None and status.get("ready") == 2

        await eventually(two_ready, 120, "two workers ready")
        # Nobody watches the recent one: it is on none of this run's workers.
        await asyncio.sleep(3.0)
        alive = {w.id for w in await registry.workers() if w.alive}
        record = await registry.get_session(recent["id"])
        assert record is not None and record.owner not in alive, record

        # Its viewer comes back: it plays again.
        async with (
            aiohttp.ClientSession() as http,
            http.get(
                f"{second.gateway_url}/v1/sessions/{recent['id']}/stream",
                headers={"Authorization": f"Bearer {recent['token']}"},
            ) as resp,
        ):
            assert resp.status == 200
            events = await read_sse(resp, 3, timeout=60)
            assert sum(1 for e in events if e.get("event") == "chunk") >= 1, events

            # 3. The floor holds: two workers, the same two, and no scale event.
            deadline = time.monotonic() + HOLD_S
            while time.monotonic() < deadline:
                alive = {w.id for w in await registry.workers() if w.alive}
                seen |= alive
                status = await registry.scheduler_status()
                assert len(alive) == 2, alive
                assert status is not None and status["gpus"] == 2, status
                assert status["releasing"] == 0 and status["draining"] == 0, status
                await asyncio.sleep(2.0)
        assert len(seen) == 2, seen  # no worker started and given back at start
        counters = await registry.counters()
        for name in ("scale_out_events", "scale_in_events"):
            assert counters.get(name, 0) == before.get(name, 0), (before, counters)
    finally:
        await asyncio.to_thread(second.stop)

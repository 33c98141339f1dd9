"""A second run of the mesh on the NATS and Redis an earlier run used, as `turboserve up` reuses
them: it settles the earlier run's sessions before its services start (nothing nobody watches
is placed; what a viewer comes back to still plays), and holds its floor of two workers with no
scale event though the earlier run's pool record says one.

Which comes first, the scheduler's election or the provisioner's record of its limits, is a race
between two processes. The test settles it the way that breaks a scheduler reading the limits
only when it takes the lead: it holds the leader's lease (as an earlier run's scheduler whose
lease has not expired yet) until the provisioner has written its floor of two, puts the earlier
run's record (one worker) back, and lets go. The scheduler is then elected on the floor of one;
once it leads, the provisioner's record comes back (as when the provisioner writes after the
election). A scheduler that read the floor only at its election would give the second worker
back within a few ticks (with no rho table there is no scale-in delay); one that follows the
record holds both for the whole window."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from shared.leader import LeaderElection
from shared.profile import DEFAULT_PROFILE, load_profile
from shared.registry import PoolLimits, Registry
from shared.states import SessionState
from tests.e2e.test_mesh import read_sse
from tests.eventually import eventually
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IDLE_AFTER_S = 2.0
CLOSE_AFTER_S = 120.0
# A scale-in comes within a few ticks of a floor taken as one: the window is many of them.
HOLD_S = 20.0
TICK_S = 0.2


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
            # As `turboserve up` runs where there is no GPU: CPU workers emulating the default
            # profile's GPU, the kind the scheduler sizes the pool in.
            "TURBOSERVE_EMULATE": load_profile(DEFAULT_PROFILE).gpu_kind,
            "TURBOSERVE_MAX_WORKERS": "3",
            "TURBOSERVE_IDLE_AFTER_S": str(IDLE_AFTER_S),
            "TURBOSERVE_CLOSE_AFTER_S": str(CLOSE_AFTER_S),
            "TURBOSERVE_TICK_S": str(TICK_S),
            # No scale-in stabilisation: a release the floor does not forbid comes at once.
            "TURBOSERVE_RHO_TABLE": "none",
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
    stale = PoolLimits(1, 3, "local")
    await registry.set_pool_limits(stale)
    await asyncio.sleep(IDLE_AFTER_S + 1)

    # 2. The second run: it says what it found and did, before any service starts. Its
    # scheduler is elected only after its provisioner wrote its floor, on the earlier record.
    before = await registry.counters()
    election = LeaderElection(redis_client, ns, "earlier-run", 120.0)
    held = await election.try_acquire()
    assert held is not None
    second = run_of(infra, isolation)
    starting = asyncio.create_task(asyncio.to_thread(second.start, 120))
    try:
        written = await floor_written(registry, stale)
        assert written.min_workers == 2, written
        await registry.set_pool_limits(stale)
        await election.resign(held)
        await eventually(
            lambda: led_after(registry, held.term), 30, "the second run's scheduler elected"
        )
        # The record the provisioner wrote, after the election.
        await registry.set_pool_limits(written)
        await starting
        line = second.earlier_sessions or ""
        assert "found 2 from an earlier run" in line and "closed 1" in line, line
        assert "1 idle until watched again" in line, line
        record = await registry.get_session(old["id"])
        assert record is not None and record.state is SessionState.TERMINATED

        seen: set[str] = set()

        async def two_ready() -> bool:
            seen.update(w.id for w in await registry.workers() if w.alive)
            status = await registry.scheduler_status()
            if status is not None and (status["releasing"] or status["draining"]):
                pytest.fail(f"the scheduler gives a worker of the floor back: {status}")
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
        if not starting.done():
            await asyncio.gather(starting, return_exceptions=True)
        await asyncio.to_thread(second.stop)


async def floor_written(registry: Registry, stale: PoolLimits) -> PoolLimits:
    """The pool record once this run's provisioner has written its own over ``stale``."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        limits = await registry.pool_limits()
        if limits is not None and limits != stale:
            return limits
        await asyncio.sleep(0.05)
    raise AssertionError("the provisioner wrote no pool record")


async def led_after(registry: Registry, term: int) -> bool:
    status = await registry.scheduler_status()
    return status is not None and int(str(status["term"])) > term

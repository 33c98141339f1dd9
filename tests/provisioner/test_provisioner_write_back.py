"""What the provisioner writes back when Redis lost it (restarted empty, or a failover lost
the write): the pool's limits and the open runs of the workers it holds, each as it opened."""

from __future__ import annotations

import time
from typing import Any

import pytest

from services.provisioner.service import ProvisionerService
from shared.meter import Meter
from shared.registry import PoolLimits
from shared.runner import running
from shared.settings import ProvisionerSettings
from shared.wire import ProvisionerCmdKind, WorkerStatus
from tests.eventually import eventually
from tests.provisioner.support import EventLog, request

pytestmark = pytest.mark.integration


@pytest.fixture
def env(infra, isolation, nats_client):  # nats_client: deletes the test's streams after it
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_GPUS": "none",
        **isolation,
    }


async def _empty(redis_client: Any, ns: str) -> None:
    keys = [k async for k in redis_client.scan_iter(match=f"{ns}:*", count=500)]
    if keys:
        await redis_client.delete(*keys)


async def test_restore_opens_only_lost_runs_and_forget_counts_nothing(redis_client, isolation):
    meter = Meter(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    await meter.open("a", at=100.0)
    assert await meter.restore({"a": 50.0, "b": 120.0}) == ["b"]
    reading = await meter.read(at=200.0)
    assert reading.open == {"a": 100.0, "b": 120.0}  # an open run is left as it is
    await meter.forget("b")
    reading = await meter.read(at=200.0)
    assert reading.open == {"a": 100.0} and reading.total_s == pytest.approx(100.0)
    assert await meter.restore({}) == []


async def test_the_open_runs_and_the_limits_come_back_after_redis_lost_them(
    env, nats_client, redis_client
):
    """Workers wait in a 60 s boot delay (no process): metered from their request."""
    settings = ProvisionerSettings.from_env(env, min_workers=0, max_workers=3, boot_delay_s=60)
    service = ProvisionerService(settings)
    ns = settings.redis_namespace
    meter = Meter(redis_client, ns)
    async with running(service, settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        reply = await request(nats_client, ctx.subjects, ProvisionerCmdKind.START, ["a", "b"])
        assert reply.started == ["a", "b"]
        await events.wait("b", WorkerStatus.BOOTING)
        opened = (await meter.read()).open
        assert set(opened) == {"a", "b"}

        await _empty(redis_client, ns)
        emptied_at = time.time()

        async def back() -> bool:
            return (await meter.read()).open == opened

        await eventually(back, 15, "the open runs written back")
        assert await ctx.registry.pool_limits() == PoolLimits(0, 3, "local")
        # Counted from when each run opened, not from the write-back.
        now = time.time()
        assert (await meter.read(at=now)).per_worker["a"] == pytest.approx(now - opened["a"])
        assert opened["a"] < emptied_at

        stopped = await request(nats_client, ctx.subjects, ProvisionerCmdKind.STOP, ["a"])
        assert stopped.stopping == ["a"]
        gone = await events.wait("a", WorkerStatus.GONE)
        reading = await meter.read()
        assert "a" not in reading.open and set(reading.open) == {"b"}
        assert reading.per_worker["a"] == pytest.approx(gone.gpu_seconds, abs=0.05)
        assert reading.per_worker["a"] > gone.at - emptied_at
        # A worker gone is not written back.
        assert await service.write_back() == []
        assert set((await meter.read()).open) == {"b"}
        # A run left open for a worker it does not hold (a failover lost its close) is closed.
        await meter.open("lost-close", at=time.time() - 3.0)

        async def closed() -> bool:
            return "lost-close" not in (await meter.read()).open

        await eventually(closed, 15, "the stale run closed")
        assert (await meter.read()).per_worker["lost-close"] >= 3.0
        assert set((await meter.read()).open) == {"b"}

"""The GPU-second meter (real Redis) and the ops endpoint (real aiohttp, NATS and Redis)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import redis.asyncio as aioredis
from prometheus_client import Counter

from shared.meter import Meter
from shared.ops import OpsServer, metrics_registry, start_ops
from shared.registry import Registry
from shared.runner import ServiceContext, close_context, open_context
from shared.settings import CommonSettings
from tools.servers import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def meter(redis_client, isolation):
    return Meter(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])


async def test_meter_counts_runs_per_worker_and_in_total(meter):
    assert await meter.open("a", at=100.0) == 100.0
    assert await meter.open("a", at=150.0) == 100.0  # idempotent: the first start holds
    await meter.open("b", at=110.0)
    reading = await meter.read(at=130.0)
    assert reading.per_worker == {"a": 30.0, "b": 20.0} and reading.total_s == 50.0
    assert reading.running == 2 and reading.open == {"a": 100.0, "b": 110.0}

    assert await meter.close("a", at=140.0) == 40.0
    assert await meter.close("a", at=999.0) is None  # closed once
    assert await meter.close("never", at=999.0) is None
    await meter.open("a", at=200.0)  # the same id again: its runs add up
    await meter.close("a", at=205.0)
    reading = await meter.read(at=210.0)
    assert reading.per_worker == {"a": 45.0, "b": 100.0}
    assert reading.total_s == 145.0 == await meter.total(at=210.0)
    assert reading.open == {"b": 110.0}
    assert await meter.close("b", at=50.0) == 0.0  # a clock that went back costs nothing


async def test_concurrent_closes_count_a_run_once(meter):
    await meter.open("w", at=0.0)
    results = await asyncio.gather(*(meter.close("w", at=10.0) for _ in range(8)))
    assert sorted(results, key=lambda r: r is None) == [10.0] + [None] * 7
    assert await meter.total(at=20.0) == 10.0


async def test_an_empty_meter_reads_zero(meter):
    reading = await meter.read()
    assert reading.total_s == 0.0 and reading.per_worker == {} and reading.running == 0


@pytest.fixture
async def ctx(infra, isolation):
    settings = CommonSettings.from_env(
        {
            "TURBOSERVE_NATS_URL": infra.nats_url,
            "TURBOSERVE_REDIS_URL": infra.redis_url,
            **isolation,
        }
    )
    context = await open_context(settings, "ops-test")
    yield context
    await close_context(context)


async def test_healthz_and_metrics_on_a_free_loopback_port(ctx):
    registry = metrics_registry()
    Counter("turboserve_test_things", "Things", registry=registry).inc(3)
    ops = await start_ops(ctx, registry, service="test", details=lambda: {"workers": 2})
    try:
        assert ops is not None and ops.host == "127.0.0.1" and ops.port > 0
        async with aiohttp.ClientSession(ops.url) as http:
            resp = await http.get("/healthz")
            assert resp.status == 200
            assert await resp.json() == {
                "status": "ok",
                "service": "test",
                "workers": 2,
                "checks": {"nats": "ok", "redis": "ok"},
            }
            resp = await http.get("/metrics")
            text = await resp.text()
            assert resp.status == 200 and resp.content_type == "text/plain"
            assert "turboserve_test_things_total 3.0" in text
            assert "process_cpu_seconds_total" in text  # the process collector is there
            assert (await http.get("/nothing")).status == 404
    finally:
        await ops.close()
        await ops.close()  # idempotent


async def test_a_failing_check_makes_healthz_503(ctx, infra):
    dead_redis = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    broken = ServiceContext(
        settings=ctx.settings,
        nc=ctx.nc,
        js=ctx.js,
        redis=dead_redis,
        registry=Registry(dead_redis),
        subjects=ctx.subjects,
    )

    async def flaky() -> bool:
        return False

    ops = await start_ops(broken, metrics_registry(), service="test", checks={"engine": flaky})
    try:
        async with aiohttp.ClientSession(ops.url) as http:
            resp = await http.get("/healthz")
            body = await resp.json()
        assert resp.status == 503 and body["status"] == "unavailable"
        assert body["checks"]["nats"] == "ok" and body["checks"]["engine"] == "failed"
        assert body["checks"]["redis"].startswith("failed: ConnectionError")
    finally:
        await ops.close()
        await dead_redis.aclose()


async def test_port_settings(ctx):
    off = ctx.settings.replace(metrics_port=-1)
    assert await start_ops(_with(ctx, off), metrics_registry(), service="test") is None

    port = free_port()
    fixed = await start_ops(
        _with(ctx, ctx.settings.replace(metrics_port=port)), metrics_registry(), service="test"
    )
    try:
        assert (
            fixed.host == "0.0.0.0" and fixed.port == port
        )  # a deployment's scrapers come from outside
        with pytest.raises(OSError):  # a named port that is taken is an error, not another port
            await start_ops(
                _with(ctx, ctx.settings.replace(metrics_port=port)),
                metrics_registry(),
                service="test",
            )
    finally:
        await fixed.close()
    with pytest.raises(ValueError, match="-1"):
        OpsServer("test", metrics_registry(), {}, port=-1)


def _with(ctx: ServiceContext, settings: CommonSettings) -> ServiceContext:
    return ServiceContext(
        settings=settings,
        nc=ctx.nc,
        js=ctx.js,
        redis=ctx.redis,
        registry=ctx.registry,
        subjects=ctx.subjects,
    )

"""The provisioner service with its local backend, against the real NATS and Redis: commands
as requests, events, limits, drain before release, metering, emulation, GPU pinning, ops.

Tests that only need the rules keep their workers in a long boot delay, so no process starts;
the others start real ``tiny`` CPU workers (a few seconds each)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import pytest

from services.provisioner.service import ProvisionerService
from shared.meter import Meter
from shared.registry import PoolLimits, WorkerRecord
from shared.runner import running
from shared.settings import ProvisionerSettings
from shared.states import SessionState
from shared.wire import ProvisionerCmdKind, ProvisionerCommand, WorkerStatus, encode
from tests.eventually import eventually
from tests.provisioner.support import EventLog, refused, request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START, STOP = ProvisionerCmdKind.START, ProvisionerCmdKind.STOP


@pytest.fixture
def env(infra, isolation, nats_client):  # nats_client: deletes the test's streams after it
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_GPUS": "none",
        **isolation,
    }


async def test_rules_replies_events_meter_and_scale_events(env, nats_client, redis_client):
    """Workers wait in a 60 s boot delay: the rules without a single process."""
    settings = ProvisionerSettings.from_env(env, min_workers=0, max_workers=2, boot_delay_s=60)
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        assert await ctx.registry.pool_limits() == PoolLimits(0, 2, "local")

        reply = await request(nats_client, ctx.subjects, START, ["a", "b", "c"], command_id="c1")
        assert reply.ok is False and reply.command_id == "c1"
        assert reply.started == ["a", "b"] and refused(reply) == [("c", "max_workers")]
        booting = await events.wait("a", WorkerStatus.BOOTING)
        assert booting.command_id == "c1" and "boot delay 60s" in booting.detail
        gone_c = await events.wait("c", WorkerStatus.GONE)
        assert gone_c.code == "max_workers" and gone_c.command_id == "c1"

        again = await request(nats_client, ctx.subjects, START, ["a"])
        assert again.ok and again.unchanged == ["a"] and not again.started
        by_count = await request(nats_client, ctx.subjects, START, count=2)
        assert refused(by_count) == [("", "max_workers"), ("", "max_workers")]

        # "b" holds a session: refused until the session is gone
        await ctx.registry.create_session("s1", "a prompt", 1)
        await ctx.registry.claim("s1", "b", expected_epoch=0)
        held = await request(nats_client, ctx.subjects, STOP, ["b"], command_id="c2")
        assert refused(held) == [("b", "not_drained")] and "s1" in held.refused[0].detail
        event = await events.wait("b", WorkerStatus.BOOTING, code="not_drained")
        assert event.command_id == "c2" and "s1" in event.detail
        await ctx.registry.transition("s1", SessionState.TERMINATED)

        # the pool's minimum holds too
        service.pool.min_workers = 2
        at_min = await request(nats_client, ctx.subjects, STOP, ["b"])
        assert refused(at_min) == [("b", "min_workers")]
        service.pool.min_workers = 0

        stopped = await request(nats_client, ctx.subjects, STOP, ["a", "b"], command_id="c3")
        assert stopped.ok and stopped.stopping == ["a", "b"]
        gone = await events.wait("a", WorkerStatus.GONE)
        assert (
            gone.code == "stopped" and gone.detail == "never launched" and gone.command_id == "c3"
        )
        assert gone.gpu_seconds is not None and gone.gpu_seconds > 0
        await events.wait("b", WorkerStatus.GONE)
        repeat = await request(nats_client, ctx.subjects, STOP, ["a", "b"])
        assert repeat.ok and repeat.unchanged == ["a", "b"]
        assert not service.backend.workers  # never a process

        reading = await Meter(redis_client, ctx.settings.redis_namespace).read()
        assert reading.open == {} and set(reading.per_worker) == {"a", "b"}
        assert reading.per_worker["a"] == pytest.approx(gone.gpu_seconds, abs=0.01)
        assert reading.total_s == pytest.approx(sum(reading.per_worker.values()))
        kinds = [(e["kind"], e["worker_id"]) for e in await ctx.registry.cluster_events()]
        assert ("scale_out", "a") in kinds and ("scale_out", "b") in kinds
        assert ("scale_in", "a") in kinds and ("scale_in", "b") in kinds

        # a malformed command is dropped; the next one is served
        await nats_client.publish(ctx.subjects.provisioner_cmd, b"\x00not a command")
        await nats_client.publish(
            ctx.subjects.provisioner_cmd,
            b'{"type":"provisioner_cmd","kind":"start","worker_ids":["bad id"]}',
        )
        ok = await request(nats_client, ctx.subjects, START, ["d"])
        assert ok.started == ["d"]
    # the provisioner stopped: "d" never launched, and says so
    gone_d = await events.wait("d", WorkerStatus.GONE)
    assert gone_d.code == "provisioner_stopped"


async def test_boot_delay_emulation_metrics_and_release(env, nats_client, redis_client):
    settings = ProvisionerSettings.from_env(
        env, min_workers=0, max_workers=2, boot_delay_s=1.0, emulate="H20"
    )
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        t0 = time.time()
        reply = await request(nats_client, ctx.subjects, START, ["e1"], gpu_kind="H20")
        assert reply.started == ["e1"]
        booting = await events.wait("e1", WorkerStatus.BOOTING)
        assert booting.emulated == "H20"
        assert not service.backend.workers  # still in its boot delay
        wrong = await request(nats_client, ctx.subjects, START, ["x"], gpu_kind="A100")
        assert refused(wrong) == [("x", "kind_unavailable")]

        ready = await events.wait("e1", WorkerStatus.READY, timeout=90)
        assert ready.boot_s is not None and ready.boot_s >= 1.0
        assert ready.emulated == "H20" and ready.gpu_kind == "H20"  # as the worker reports it
        assert ready.at - t0 >= 1.0

        assert service.ops is not None
        async with aiohttp.ClientSession(service.ops.url) as http:
            health = await http.get("/healthz")
            body = await health.json()
            assert health.status == 200 and body["status"] == "ok"
            assert body["checks"] == {"nats": "ok", "redis": "ok"}
            assert body["workers"]["ready"] == 1 and body["emulated"] == "H20"
            text = await (await http.get("/metrics")).text()
        labels = 'emulated="true",kind="H20"'
        assert f'turboserve_provisioner_workers{{{labels},state="ready"}} 1.0' in text
        assert f"turboserve_provisioner_boots_total{{{labels}}} 1.0" in text
        assert f"turboserve_provisioner_boot_seconds_count{{{labels}}} 1.0" in text
        assert _metric(text, f"turboserve_provisioner_gpu_seconds_total{{{labels}}}") >= 1.0
        assert (
            'turboserve_provisioner_refused_total{code="kind_unavailable",command="start"} 1.0'
            in text
        )
        assert 'turboserve_provisioner_pool_limit{backend="local",bound="max"} 2.0' in text

        pid = service.backend.workers["e1"].process.pid
        stopped = await request(nats_client, ctx.subjects, STOP, ["e1"])
        assert stopped.stopping == ["e1"]
        gone = await events.wait("e1", WorkerStatus.GONE, timeout=30)
        assert gone.code == "stopped" and gone.detail == "exit code 0"  # a clean shutdown
        assert gone.gpu_seconds >= ready.boot_s
        assert not _alive(pid)
        total = await Meter(redis_client, ctx.settings.redis_namespace).total()
        assert total == pytest.approx(gone.gpu_seconds, abs=0.01)


async def test_one_worker_per_gpu_pinned_by_uuid(env, nats_client, monkeypatch):
    # CUDA_VISIBLE_DEVICES naming GPUs this CPU host lacks: the workers run on the CPU, and
    # what matters here is what each was given.
    settings = ProvisionerSettings.from_env(
        {**env, "TURBOSERVE_GPUS": "GPU-aaaa,GPU-bbbb"}, min_workers=0, max_workers=8
    )
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        assert await ctx.registry.pool_limits() == PoolLimits(0, 2, "local")
        reply = await request(nats_client, ctx.subjects, START, ["g1", "g2", "g3"])
        assert reply.started == ["g1", "g2"] and refused(reply) == [("g3", "no_gpu")]
        await eventually(lambda: len(service.backend.workers) == 2)
        pinned = {
            wid: _environ(w.process.pid).get("CUDA_VISIBLE_DEVICES")
            for wid, w in service.backend.workers.items()
        }
        assert sorted(pinned.values()) == ["GPU-aaaa", "GPU-bbbb"]
        env_g1 = _environ(service.backend.workers["g1"].process.pid)
        assert env_g1["TURBOSERVE_WORKER_ID"] == "g1"
        assert env_g1["TURBOSERVE_SUBJECT_PREFIX"] == ctx.settings.subject_prefix
        # a released GPU is handed out again
        await request(nats_client, ctx.subjects, STOP, ["g1"])
        await events.wait("g1", WorkerStatus.GONE)
        again = await request(nats_client, ctx.subjects, START, ["g3"])
        assert again.started == ["g3"]
        await eventually(lambda: "g3" in service.backend.workers)
        assert (
            _environ(service.backend.workers["g3"].process.pid)["CUDA_VISIBLE_DEVICES"]
            == pinned["g1"]
        )


async def test_a_worker_that_does_not_boot_in_time_is_stopped(env, nats_client):
    settings = ProvisionerSettings.from_env(env, min_workers=0, max_workers=1, boot_timeout_s=0.5)
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        await request(nats_client, ctx.subjects, START, ["slow"])
        await eventually(lambda: "slow" in service.backend.workers)
        pid = service.backend.workers["slow"].process.pid
        gone = await events.wait("slow", WorkerStatus.GONE, timeout=30)
        assert gone.code == "boot_timeout" and not _alive(pid)
        assert WorkerStatus.READY not in events.statuses("slow")


async def test_min_workers_are_started_and_stop_with_the_provisioner(
    env, nats_client, redis_client
):
    settings = ProvisionerSettings.from_env(env, min_workers=1, max_workers=2)
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        ready = await events.wait(None, WorkerStatus.READY, timeout=90)
        assert list(service.backend.workers) == [ready.worker_id]
        pid = service.backend.workers[ready.worker_id].process.pid
        alone = await request(nats_client, ctx.subjects, STOP, [ready.worker_id])
        assert refused(alone) == [(ready.worker_id, "min_workers")]
    gone = await events.wait(ready.worker_id, WorkerStatus.GONE, timeout=30)
    assert gone.code == "provisioner_stopped" and not _alive(pid)
    assert (await Meter(redis_client, settings.redis_namespace).read()).open == {}


async def test_a_second_provisioner_closes_meters_of_workers_it_does_not_run(
    env, nats_client, redis_client
):
    settings = ProvisionerSettings.from_env(env, min_workers=0, max_workers=2)
    meter = Meter(redis_client, settings.redis_namespace)
    await meter.open("orphan", at=time.time() - 5.0)  # a worker whose provisioner was killed
    async with running(ProvisionerService(settings), settings) as ctx:
        del ctx
    reading = await meter.read()
    assert reading.open == {} and reading.per_worker["orphan"] >= 5.0


async def test_refuses_an_id_a_live_worker_already_has(env, nats_client):
    settings = ProvisionerSettings.from_env(env, min_workers=0, max_workers=2, boot_delay_s=60)
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        await ctx.registry.register_worker(
            WorkerRecord(id="taken", status=WorkerStatus.READY, capacity=8), ttl_s=30
        )
        reply = await request(nats_client, ctx.subjects, START, ["taken"])
        assert refused(reply) == [("taken", "id_in_use")]
        await asyncio.sleep(0.3)
        assert events.of("taken") == []  # that worker is alive: no "gone" about it
        plain = ProvisionerCommand(kind=START, worker_ids=["free"])
        await nats_client.publish(ctx.subjects.provisioner_cmd, encode(plain))
        await events.wait("free", WorkerStatus.BOOTING)  # a plain publish works too


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in the metrics")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_each_worker_logs_to_its_own_file_and_the_provisioner_only_json(
    env, tmp_path, redis_client
):
    """As ``turboserve up --logs file`` runs it: the provisioner's output, piped, is JSON from
    its first line (the GPUs it looks for included); each worker it starts writes its own
    ``worker-<id>.log``."""
    import json
    import signal
    import subprocess
    import sys

    from shared.registry import Registry

    penv = {
        **os.environ,
        **env,
        "TURBOSERVE_LOG_LEVEL": "info",
        "TURBOSERVE_GPUS": "auto",
        "TURBOSERVE_MIN_WORKERS": "1",
        "TURBOSERVE_MAX_WORKERS": "1",
        "TURBOSERVE_WORKER_LOG_DIR": str(tmp_path / "logs"),
        "TURBOSERVE_LOG_FORMAT": "auto",
    }
    penv.pop("TURBOSERVE_EMULATE", None)
    out_path = tmp_path / "provisioner.log"
    with open(out_path, "wb") as out:  # noqa: ASYNC230 - a local file, opened once
        proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
            [sys.executable, "-m", "tools.cli", "provisioner"],
            env=penv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    registry = Registry(redis_client, env["TURBOSERVE_REDIS_NAMESPACE"])
    try:

        async def a_worker_ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the provisioner exited: {out_path.read_text()}")
            return any(w.alive and w.status is WorkerStatus.READY for w in await registry.workers())

        await eventually(a_worker_ready, timeout=90, what="a worker ready")
        (worker,) = await registry.workers()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    lines = out_path.read_text().splitlines()
    assert lines and all(line.startswith("{") for line in lines), [
        line for line in lines if not line.startswith("{")
    ]
    events = [json.loads(line)["event"] for line in lines]
    assert "no_gpu" in events or "gpus_found" in events or "local_backend" in events
    assert "worker_starting" not in events  # the worker's lines are in its own file
    own = (tmp_path / "logs" / f"worker-{worker.id}.log").read_text().splitlines()
    assert own and all(line.startswith("{") for line in own)
    assert "worker_starting" in {json.loads(line)["event"] for line in own}

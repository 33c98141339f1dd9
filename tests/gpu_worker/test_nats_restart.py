"""NATS restarted under running services: each reconnects by itself, streams resume, and the
session events published around the restart are kept by JetStream and acted on."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from services.scheduler.service import SchedulerService
from shared.runner import running
from shared.settings import SchedulerSettings
from shared.wire import SessionEvent, SessionEventKind, encode
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import worker_in_process
from tools.launcher import free_port, nats_server_binary, probe_nats

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def start_nats(port: int, store) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_services_reconnect_and_streams_resume_after_a_nats_restart(
    infra, isolation, redis_client, tmp_path
):
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    nats = start_nats(port, tmp_path / "js")
    try:
        await eventually(lambda: probe_nats(url), 10, "nats-server up")
        env = {
            "TURBOSERVE_NATS_URL": url,
            "TURBOSERVE_REDIS_URL": infra.redis_url,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_METRICS_PORT": "-1",
            **isolation,
        }
        settings = SchedulerSettings.from_env(env, tick_s=0.25, worker_timeout_s=10.0)
        async with (
            worker_in_process(env, worker_id="w1", chunk_period_s=0.25) as (_, ctx, rx),
            running(SchedulerService(settings), settings),
        ):
            await create(ctx, "before")
            await eventually(lambda: len(rx.chunks["before"]) >= 3, 30, "chunks")
            nats.terminate()
            await asyncio.to_thread(nats.wait)
            await asyncio.sleep(1.0)  # the outage is the test: the services see the server gone
            nats = start_nats(port, tmp_path / "js")
            await eventually(lambda: probe_nats(url), 10, "nats-server up")
            # Published as soon as the server is back, before the scheduler has reconnected
            # (or while it does): JetStream keeps it for the scheduler's durable consumer.
            await ctx.registry.create_session("after", "p", 2)
            for _ in range(100):
                try:
                    await ctx.js.publish(
                        ctx.subjects.session_events,
                        encode(SessionEvent(session_id="after", kind=SessionEventKind.CREATED)),
                        timeout=1,
                    )
                    break
                except Exception:  # noqa: BLE001 - our own connection is still reconnecting
                    await asyncio.sleep(0.2)
            count = len(rx.chunks["before"])
            await eventually(
                lambda: len(rx.chunks["before"]) >= count + 4, 60, "the stream to resume"
            )
            await eventually(
                lambda: len(rx.chunks["after"]) >= 2, 60, "the session created after the restart"
            )
        for sid in ("before", "after"):
            seqs = rx.seqs(sid)
            assert sorted(set(seqs)) == list(range(max(seqs) + 1)), (sid, seqs)
    finally:
        nats.terminate()
        nats.wait()


async def create(ctx, sid: str) -> None:
    await ctx.registry.create_session(sid, "p", 1)
    await ctx.js.publish(
        ctx.subjects.session_events,
        encode(SessionEvent(session_id=sid, kind=SessionEventKind.CREATED)),
    )

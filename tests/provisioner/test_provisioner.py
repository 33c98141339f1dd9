"""The provisioner's local backend with real worker processes."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.provisioner.service import ProvisionerService
from shared.runner import running, subscriptions_live
from shared.settings import ProvisionerSettings
from shared.wire import (
    ProvisionerCmdKind,
    ProvisionerCommand,
    ProvisionerEvent,
    WorkerStatus,
    decode,
    encode,
)
from tests.eventually import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_refuses_duplicate_ids_and_replaces_a_dead_worker(
    infra, isolation, nats_client, redis_client
):
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
    }
    settings = ProvisionerSettings.from_env(
        env, min_workers=0, max_workers=2, shutdown_grace_s=10.0
    )
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        events = await nats_client.subscribe(ctx.subjects.provisioner_events)
        await subscriptions_live(nats_client)
        cmd = ProvisionerCommand(kind=ProvisionerCmdKind.START, worker_ids=["dup", "dup"])
        await nats_client.publish(ctx.subjects.provisioner_cmd, encode(cmd))
        first = decode("e", (await events.next_msg(timeout=10)).data, ProvisionerEvent)
        assert first.worker_id == "dup" and first.status is WorkerStatus.BOOTING
        ready = decode("e", (await events.next_msg(timeout=60)).data, ProvisionerEvent)
        assert ready.worker_id == "dup" and ready.status is WorkerStatus.READY, ready
        assert ready.boot_s is not None and ready.boot_s > 0
        with pytest.raises(asyncio.TimeoutError):  # the second "dup" started nothing
            await events.next_msg(timeout=1.0)
        assert list(service.backend.workers) == ["dup"]

        # keep one running: kill it, and a replacement appears
        service.pool.min_workers = 1
        os.kill(service.backend.workers["dup"].process.pid, signal.SIGKILL)
        gone = decode("e", (await events.next_msg(timeout=20)).data, ProvisionerEvent)
        assert (
            gone.worker_id == "dup" and gone.status is WorkerStatus.GONE and gone.code == "exited"
        )
        assert gone.gpu_seconds is not None and gone.gpu_seconds > 0
        booting = decode("e", (await events.next_msg(timeout=20)).data, ProvisionerEvent)
        assert booting.status is WorkerStatus.BOOTING and booting.worker_id != "dup"
        ready = decode("e", (await events.next_msg(timeout=60)).data, ProvisionerEvent)
        assert ready.worker_id == booting.worker_id and ready.status is WorkerStatus.READY
        pids = [w.process.pid for w in service.backend.workers.values()]
        assert len(pids) == 1
    # stopped with the service: no worker process left
    await eventually(
        lambda: not any(_alive(pid) for pid in pids), 30, "the worker gone with the provisioner"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

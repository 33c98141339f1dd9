"""The Kubernetes backend against a minimal fake of the API server (no cluster can run here):
the real ``kubernetes`` client talks to an aiohttp fake on loopback over HTTP, through a
kubeconfig. The service-level tests add the real NATS and Redis; the "workers" are pods nothing
runs, so a test sends their READY heartbeat itself."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.provisioner.backends.base import LaunchError
from services.provisioner.backends.k8s import (
    API_USE,
    POOL_LABEL,
    WORKER_ID_ANNOTATION,
    KubernetesBackend,
    pod_name,
)
from services.provisioner.pool import ManagedState
from services.provisioner.service import ProvisionerService
from shared.callout import IssuerKey
from shared.enrol import ENROL_UNKNOWN_WORKER, EnrolKey
from shared.meter import Meter
from shared.registry import PoolLimits, WorkerRecord
from shared.runner import running
from shared.settings import ProvisionerSettings
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
from tests.provisioner.kube_fake import FakeKube
from tests.provisioner.support import EventLog, refused, request

pytestmark = pytest.mark.integration

NS = "gpu"
TEMPLATE = {
    "metadata": {"labels": {"team": "video"}},
    "spec": {
        "containers": [
            {"name": "sidecar", "image": "busybox"},
            {
                "name": "worker",
                "image": "turboserve:latest",
                "args": ["worker"],
                "env": [
                    {"name": "TURBOSERVE_PRESET", "value": "wan-1.3b"},
                    {"name": "TURBOSERVE_WORKER_ID", "value": "wrong"},
                ],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            },
        ],
        "restartPolicy": "Always",
    },
}


@pytest.fixture
async def kube(tmp_path, monkeypatch):
    fake = FakeKube()
    await fake.start()
    fake.add_template(NS, "turboserve-worker", TEMPLATE)
    monkeypatch.setenv("KUBECONFIG", str(fake.write_kubeconfig(tmp_path / "kubeconfig", NS)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield fake
    await fake.stop()


def k8s_settings(env=None, **overrides) -> ProvisionerSettings:
    base = {
        "TURBOSERVE_BACKEND": "kubernetes",
        "TURBOSERVE_K8S_POLL_S": "0.1",
        "TURBOSERVE_LOG_LEVEL": "warning",
        **(env or {}),
    }
    return ProvisionerSettings.from_env(base, **overrides)


class Exits:
    """A backend's on_exit and spawn, recorded."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.tasks: list[asyncio.Task] = []

    def __call__(self, worker_id: str, detail: str) -> None:
        self.seen.append((worker_id, detail))

    def spawn(self, coro, name):
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


async def test_launch_makes_a_pod_from_the_template(kube):
    backend = KubernetesBackend(k8s_settings(emulate="H20", subject_prefix="Pool_1"))
    exits = Exits()
    assert await backend.open(exits.spawn, exits) == {}
    try:
        where = await backend.launch("Gpu_7")
        name = pod_name("Pool_1", "Gpu_7")
        assert where == f"pod {name}" and backend.namespace == NS  # the kubeconfig's namespace
        pod = kube.pods[(NS, name)]
        assert pod["metadata"]["annotations"][WORKER_ID_ANNOTATION] == "Gpu_7"
        labels = pod["metadata"]["labels"]
        assert labels["team"] == "video" and labels[POOL_LABEL] == "Pool_1"
        assert labels["app.kubernetes.io/component"] == "worker"
        assert pod["spec"]["restartPolicy"] == "Never"
        sidecar, worker = pod["spec"]["containers"]
        assert "env" not in sidecar
        env = {e["name"]: e["value"] for e in worker["env"]}
        assert env == {
            "TURBOSERVE_PRESET": "wan-1.3b",
            "TURBOSERVE_WORKER_ID": "Gpu_7",
            "TURBOSERVE_SUBJECT_PREFIX": "Pool_1",
            "TURBOSERVE_REDIS_NAMESPACE": "ts",
            "TURBOSERVE_EMULATE": "H20",
        }
        # a second launch of the same worker is the same pod (409 from the API)
        assert await backend.launch("Gpu_7") == where and len(kube.pods) == 1
    finally:
        exits.cancel()


async def test_terminate_deletes_the_pod_and_is_idempotent(kube):
    backend = KubernetesBackend(k8s_settings())
    exits = Exits()
    await backend.open(exits.spawn, exits)
    try:
        await backend.launch("a")
        assert await backend.terminate("a", grace_s=5) == f"pod {pod_name('ts', 'a')} deleted"
        assert not kube.pods
        assert ("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod_name('ts', 'a')}") in kube.requests
        assert "already gone" in await backend.terminate("a", grace_s=5)
        await asyncio.sleep(0.3)
        assert exits.seen == []  # stopped by us: no exit reported
    finally:
        exits.cancel()


async def test_poll_reports_failed_and_vanished_pods(kube):
    backend = KubernetesBackend(k8s_settings())
    exits = Exits()
    await backend.open(exits.spawn, exits)
    try:
        await backend.launch("a")
        await backend.launch("b")
        kube.set_phase(NS, pod_name("ts", "a"), "Failed", reason="OOMKilled", exit_code=137)
        await eventually(lambda: exits.seen, what="the failed pod reported")
        assert exits.seen == [("a", f"pod {pod_name('ts', 'a')} Failed: OOMKilled (exit code 137)")]
        await eventually(
            lambda: (NS, pod_name("ts", "a")) not in kube.pods, what="the failed pod cleaned up"
        )
        kube.vanish(NS, pod_name("ts", "b"))
        await eventually(lambda: len(exits.seen) == 2, what="the vanished pod reported")
        assert exits.seen[1] == ("b", f"pod {pod_name('ts', 'b')} deleted")
    finally:
        exits.cancel()


async def test_open_takes_over_running_pods_and_clears_dead_ones(kube):
    first = KubernetesBackend(k8s_settings())
    exits = Exits()
    await first.open(exits.spawn, exits)
    await first.launch("alive")
    await first.launch("dead")
    await first.launch("other-pool")
    exits.cancel()
    kube.pods[(NS, pod_name("ts", "other-pool"))]["metadata"]["labels"][POOL_LABEL] = "elsewhere"
    kube.set_phase(NS, pod_name("ts", "alive"), "Running")
    kube.set_phase(NS, pod_name("ts", "dead"), "Failed", exit_code=1)

    second = KubernetesBackend(k8s_settings())
    exits2 = Exits()
    try:
        adopted = await second.open(exits2.spawn, exits2)
        assert set(adopted) == {"alive"}
        assert abs(adopted["alive"] - time.time()) < 60  # its creation time
        assert (NS, pod_name("ts", "dead")) not in kube.pods
        assert (NS, pod_name("ts", "other-pool")) in kube.pods  # not ours: untouched
        assert await second.close(grace_s=1) == [] and (NS, pod_name("ts", "alive")) in kube.pods
    finally:
        exits2.cancel()


async def test_launch_errors_name_the_pod_and_the_api_answer(kube):
    backend = KubernetesBackend(k8s_settings())
    exits = Exits()
    await backend.open(exits.spawn, exits)
    try:
        kube.refuse_create = (403, "Forbidden")
        with pytest.raises(LaunchError, match="403 Forbidden"):
            await backend.launch("a")
        kube.refuse_create = None
        kube.templates.clear()
        with pytest.raises(LaunchError, match="not found"):
            await backend.launch("a")
        assert not kube.pods
    finally:
        exits.cancel()


# -- the service with the Kubernetes backend, the real NATS and Redis -------------------------------


async def _ready(nc, subjects, worker_id: str) -> None:
    """The heartbeat the worker in the pod would send once its model is loaded."""
    beat = Heartbeat(
        worker_id=worker_id, status=WorkerStatus.READY, capacity=12, active=0, gpu_kind="H100"
    )
    await nc.publish(subjects.worker_heartbeat(beat.worker_id), encode(beat))


async def test_service_scales_pods_by_name_and_survives_its_own_restart(
    kube, infra, isolation, nats_client, redis_client
):
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        **isolation,
    }
    settings = k8s_settings(env, min_workers=1, max_workers=3)
    prefix = settings.subject_prefix
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        events = await EventLog.listen(nats_client, ctx.subjects)
        assert await ctx.registry.pool_limits() == PoolLimits(1, 3, "kubernetes")
        [first_id] = service.pool.workers  # min_workers, started before we listened
        await eventually(lambda: len(kube.pods_in(NS)) == 1)
        await _ready(nats_client, ctx.subjects, first_id)
        assert (await events.wait(first_id, WorkerStatus.READY)).gpu_kind == "H100"

        reply = await request(nats_client, ctx.subjects, ProvisionerCmdKind.START, ["g1", "g2"])
        assert reply.started == ["g1", "g2"]
        await eventually(lambda: len(kube.pods_in(NS)) == 3)
        for wid in ("g1", "g2"):
            await _ready(nats_client, ctx.subjects, wid)
            await events.wait(wid, WorkerStatus.READY)

        # drain before release: the worker's own record says it holds a session
        holding = WorkerRecord(id="g1", status=WorkerStatus.READY, capacity=12, sessions=("s9",))
        await ctx.registry.register_worker(holding, ttl_s=30)
        held = await request(nats_client, ctx.subjects, ProvisionerCmdKind.STOP, ["g1"])
        assert refused(held) == [("g1", "not_drained")]
        assert (NS, pod_name(prefix, "g1")) in kube.pods
        await ctx.registry.register_worker(
            WorkerRecord(id="g1", status=WorkerStatus.READY, capacity=12), ttl_s=30
        )
        released = await request(nats_client, ctx.subjects, ProvisionerCmdKind.STOP, ["g1"])
        assert released.stopping == ["g1"]
        gone = await events.wait("g1", WorkerStatus.GONE)
        assert gone.code == "stopped" and gone.detail == f"pod {pod_name(prefix, 'g1')} deleted"
        assert (NS, pod_name(prefix, "g1")) not in kube.pods

        # a pod that fails is reported with what its container said
        kube.set_phase(NS, pod_name(prefix, "g2"), "Failed", reason="OOMKilled", exit_code=137)
        lost = await events.wait("g2", WorkerStatus.GONE)
        assert lost.code == "exited" and "OOMKilled (exit code 137)" in lost.detail

        # a delete the API refuses is tried again until it works: the worker is gone only then
        kube.refuse_delete = (503, "ServiceUnavailable")
        await request(nats_client, ctx.subjects, ProvisionerCmdKind.START, ["g3"])
        await eventually(lambda: (NS, pod_name(prefix, "g3")) in kube.pods)
        stopping = await request(nats_client, ctx.subjects, ProvisionerCmdKind.STOP, ["g3"])
        assert stopping.stopping == ["g3"]
        g3 = ("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod_name(prefix, 'g3')}")
        await eventually(lambda: kube.requests.count(g3) >= 2, what="a first try and a retry")
        assert (NS, pod_name(prefix, "g3")) in kube.pods
        assert WorkerStatus.GONE not in events.statuses("g3")
        kube.refuse_delete = None
        assert (await events.wait("g3", WorkerStatus.GONE)).code == "stopped"
        assert (NS, pod_name(prefix, "g3")) not in kube.pods

        # a refused pod: accepted, then gone with the API's answer
        kube.refuse_create = (403, "Forbidden")
        await request(nats_client, ctx.subjects, ProvisionerCmdKind.START, ["bad"])
        failed = await events.wait("bad", WorkerStatus.GONE)
        assert failed.code == "launch_failed" and "403 Forbidden" in failed.detail
        kube.refuse_create = None
    # pods outlive the provisioner, and their meters keep running
    assert set(kube.pods_in(NS)) == {pod_name(prefix, first_id)}
    meter = Meter(redis_client, settings.redis_namespace)
    assert set((await meter.read()).open) == {first_id}
    kinds = [e["kind"] for e in await ctx.registry.cluster_events()]
    assert kinds.count("scale_out") == 5 and kinds.count("scale_in") == 2
    assert kinds.count("worker_lost") == 2

    # the next provisioner takes the running pod over: no new pod for min_workers
    successor = ProvisionerService(settings)
    async with running(successor, settings) as ctx:
        assert list(successor.pool.workers) == [first_id]
        await _ready(nats_client, ctx.subjects, first_id)
        await eventually(lambda: successor.pool.counts()[ManagedState.READY] == 1)
        assert len(kube.pods_in(NS)) == 1
        # and it notices when that pod goes: the pool is refilled to its minimum
        kube.vanish(NS, pod_name(prefix, first_id))
        gone = await events.wait(first_id, WorkerStatus.GONE)
        assert gone.code == "exited"
        await eventually(lambda: len(kube.pods_in(NS)) == 1, timeout=15)
    assert first_id not in (await meter.read()).open
    # every call the backend made is one the provisioner's Role grants (and it made them all)
    assert kube.verbs_used() == {(r, v) for r, verbs in API_USE.items() for v in verbs}


async def test_with_the_callout_its_pods_enrol_and_no_one_else(
    kube, infra, isolation, nats_client, redis_client
):
    """Pods get no credential in their spec (anyone who reads pods would see it): each enrols
    once it runs. Only an id of one of its pods is enrolled; any other is ``unknown_worker``."""
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_CALLOUT_KEY": IssuerKey.generate().text(),
        **isolation,
    }
    settings = k8s_settings(env, min_workers=1, max_workers=2)
    service = ProvisionerService(settings)
    async with running(service, settings) as ctx:
        [pod_id] = service.pool.workers
        await eventually(lambda: len(kube.pods_in(NS)) == 1)
        [pod] = kube.pods_in(NS).values()
        [worker] = [c for c in pod["spec"]["containers"] if c["name"] == "worker"]
        assert "TURBOSERVE_NATS_URL" not in {e["name"] for e in worker["env"]}
        credentials = f"{settings.redis_namespace}:worker_credentials"
        assert not await redis_client.hexists(credentials, pod_id)  # none minted at launch

        async def ask(worker_id: str) -> tuple[EnrolReply, EnrolKey]:
            key = EnrolKey()
            request_ = EnrolRequest(worker_id=worker_id, public_key=key.public)
            msg = await nats_client.request(
                ctx.subjects.provisioner_enrol, encode(request_), timeout=5
            )
            return decode(msg.subject, msg.data, EnrolReply), key

        reply, key = await ask(pod_id)
        assert reply.ok, reply
        password = key.open(reply.sealed, pod_id)
        assert await service.credentials.check(pod_id, password)  # type: ignore[union-attr]
        stranger, _ = await ask("not-a-pod")
        assert not stranger.ok and stranger.code == ENROL_UNKNOWN_WORKER
        assert not await redis_client.hexists(credentials, "not-a-pod")

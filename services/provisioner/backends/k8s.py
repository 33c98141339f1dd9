"""The Kubernetes backend: one pod per worker, created and deleted by name.

Why pods by name and not a StatefulSet: the scheduler names the GPU it wants (``RequestGpus``)
and the one it has drained (``Release``); a StatefulSet only scales by count and always removes
its highest ordinal, which may be a worker that still holds sessions. A pod per worker, named
after the worker id, makes START and STOP exact and idempotent (a second create is a 409, a
second delete a 404).

Each pod is made from a PodTemplate (``TURBOSERVE_K8S_POD_TEMPLATE``, read at every launch, so
an edited template applies to the next worker) with, in its container named ``worker`` (or its
first one), ``TURBOSERVE_WORKER_ID`` and the settings a worker must share with its provisioner
(subject prefix, Redis namespace, the emulated GPU kind when one is set). The NATS and Redis URLs
come from the template (a ConfigMap or Secret): they may carry credentials, which a pod spec
would show to anyone who may read pods. ``restartPolicy`` is ``Never``: a worker that dies is
reported gone and replaced under a new id, never restarted in place.

Pods are listed every ``TURBOSERVE_K8S_POLL_S`` to notice the ones that died or were deleted by
someone else; at start the provisioner takes over the pods of its pool that are still running
(a rolling update of the provisioner does not kill the GPU workers).

Tested against a minimal fake of the API server (aiohttp on loopback; the real ``kubernetes``
client talks to it over HTTP): never against a real cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from services.provisioner.backends.base import (
    BackendError,
    BackendUnavailable,
    LaunchError,
    OnExit,
    Spawn,
    mesh_env,
)
from shared.logging import get_logger
from shared.settings import ProvisionerSettings

log = get_logger("turboserve.provisioner")

WORKER_ID_ANNOTATION = "turboserve.io/worker-id"
POOL_LABEL = "turboserve.io/pool"
COMPONENT_LABELS = {"app.kubernetes.io/name": "turboserve", "app.kubernetes.io/component": "worker"}
WORKER_CONTAINER = "worker"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
REQUEST_TIMEOUT = (5, 30)  # connect, read (seconds)
TERMINAL_PHASES = ("Succeeded", "Failed")
GONE_MARGIN_S = 30.0  # how long past the grace period a deleted pod may take to go
# Every API call the backend makes, as RBAC sees it: the provisioner's Role grants exactly this.
API_USE = {"pods": ("get", "list", "create", "delete"), "podtemplates": ("get",)}


def pod_name(prefix: str, worker_id: str) -> str:
    """A DNS-1123 name, unique per (prefix, worker id): readable slugs plus a hash of both."""
    digest = hashlib.sha1(f"{prefix}/{worker_id}".encode()).hexdigest()[:8]
    head = f"{_slug(prefix)}-worker-{_slug(worker_id)}"[: 63 - len(digest) - 1].strip("-")
    return f"{head}-{digest}"


def pool_label(prefix: str) -> str:
    """The subject prefix as a label value (alphanumeric at both ends)."""
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", prefix) or "pool"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "x"


class KubernetesBackend:
    name = "kubernetes"
    credential_at_launch = False  # its pods enrol (the pod template's TURBOSERVE_ENROL)
    capacity: int | None = None  # the cluster's GPUs are the scheduler's and Kubernetes' concern

    def __init__(self, settings: ProvisionerSettings) -> None:
        try:
            from kubernetes import client, config
        except ImportError:
            raise BackendUnavailable(
                "the kubernetes backend needs the kubernetes package: pip install 'turboserve[k8s]'"
            ) from None
        self.settings = settings
        self._client = client
        try:
            configuration, namespace = _load_configuration()
        except (config.ConfigException, OSError) as exc:
            raise BackendUnavailable(
                f"no Kubernetes configuration: {exc} (in a pod: a service "
                "account; elsewhere: KUBECONFIG or ~/.kube/config)"
            ) from None
        # The client is untyped: its objects are Any here.
        self.api_client: Any = client.ApiClient(configuration)
        self.api = client.CoreV1Api(self.api_client)
        self.namespace = settings.k8s_namespace or namespace
        self.selector = ",".join(f"{k}={v}" for k, v in self.labels.items())
        self.pods: dict[str, str] = {}  # worker id -> pod name, for the pods it runs
        self._on_exit: OnExit | None = None

    @property
    def _api_errors(self) -> tuple[type[Exception], ...]:
        """What a call to the API raises when it fails: an answer, or no answer."""
        return (self._client.ApiException, OSError, _urllib3_error())

    @property
    def labels(self) -> dict[str, str]:
        return {**COMPONENT_LABELS, POOL_LABEL: pool_label(self.settings.subject_prefix)}

    # -- the Backend interface --------------------------------------------------------------------
    async def open(self, spawn: Spawn, on_exit: OnExit) -> dict[str, float]:
        log.info(
            "kubernetes_backend",
            host=self.api_client.configuration.host,
            namespace=self.namespace,
            pod_template=self.settings.k8s_pod_template,
        )
        self._on_exit = on_exit
        adopted: dict[str, float] = {}
        for pod in await self._list_pods():
            worker_id = _worker_id(pod)
            if worker_id is None:
                continue
            if _phase(pod) in TERMINAL_PHASES:
                await self._delete(pod["metadata"]["name"], grace_s=0)  # died while unwatched
                continue
            self.pods[worker_id] = pod["metadata"]["name"]
            adopted[worker_id] = _created_at(pod)
        if adopted:
            log.info("pods_adopted", workers=sorted(adopted))
        spawn(self._poll_forever(), "k8s-poll")
        return adopted

    async def launch(self, worker_id: str, nats_url: str | None = None) -> str:
        # nats_url is never given here (credential_at_launch): a pod enrols once it runs.
        name = pod_name(self.settings.subject_prefix, worker_id)
        try:
            await self._create(worker_id, name)
        except self._api_errors as exc:
            raise LaunchError(f"pod {name}: {_api_message(exc)}") from None
        self.pods[worker_id] = name
        log.info("worker_pod_created", worker_id=worker_id, pod=name, namespace=self.namespace)
        return f"pod {name}"

    async def terminate(self, worker_id: str, grace_s: float) -> str:
        name = self.pods.get(worker_id) or pod_name(self.settings.subject_prefix, worker_id)
        try:
            deleted = await self._delete(name, grace_s)
        except self._api_errors as exc:
            raise BackendError(f"deleting pod {name}: {_api_message(exc)}") from None
        self.pods.pop(worker_id, None)  # deleted (or gone already): no longer ours to watch
        if not deleted:
            return f"pod {name} was already gone"
        deadline = time.monotonic() + grace_s + GONE_MARGIN_S
        while time.monotonic() < deadline:
            try:
                pod = await self._read_pod(name)
            except self._api_errors:
                pod = {}  # the API is away: the pod is deleted all the same, keep waiting
            if pod is None or (pod and _phase(pod) in TERMINAL_PHASES):
                return f"pod {name} deleted"
            await asyncio.sleep(min(1.0, self.settings.k8s_poll_s))
        return f"pod {name} deleted, still terminating after {grace_s + GONE_MARGIN_S:.0f}s"

    async def close(self, grace_s: float) -> list[str]:
        return []  # pods outlive the provisioner; the next one takes them over

    # -- pods -------------------------------------------------------------------------------------
    async def _create(self, worker_id: str, name: str) -> None:
        template = await self._call(
            self.api.read_namespaced_pod_template, self.settings.k8s_pod_template, self.namespace
        )
        body = self.pod_body(
            worker_id, self.api_client.sanitize_for_serialization(template.template)
        )
        try:
            await self._call(self.api.create_namespaced_pod, self.namespace, body)
        except self._client.ApiException as exc:
            if exc.status != 409:
                raise
            existing = await self._read_pod(name)  # created before: the same worker's, or a clash
            if existing is None or _worker_id(existing) != worker_id:
                raise LaunchError(f"pod {name} exists and is not worker {worker_id}") from None

    def pod_body(self, worker_id: str, template: dict[str, Any]) -> dict[str, Any]:
        """A pod for ``worker_id`` from a PodTemplate's ``template`` (API field names)."""
        metadata = dict(template.get("metadata") or {})
        spec = dict(template.get("spec") or {})
        containers = [dict(c) for c in spec.get("containers") or []]
        if not containers:
            raise LaunchError(f"PodTemplate {self.settings.k8s_pod_template} has no container")
        target = next((c for c in containers if c.get("name") == WORKER_CONTAINER), containers[0])
        ours = {"TURBOSERVE_WORKER_ID": worker_id, **mesh_env(self.settings)}
        env = [e for e in target.get("env") or [] if e.get("name") not in ours]
        target["env"] = env + [{"name": k, "value": v} for k, v in ours.items()]
        spec.update(containers=containers, restartPolicy="Never")
        metadata.pop("generateName", None)
        metadata.update(
            name=pod_name(self.settings.subject_prefix, worker_id),
            namespace=self.namespace,
            labels={**(metadata.get("labels") or {}), **self.labels},
            annotations={**(metadata.get("annotations") or {}), WORKER_ID_ANNOTATION: worker_id},
        )
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}

    async def _poll_forever(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.settings.k8s_poll_s)
            try:
                pods = await self._list_pods()
            except self._api_errors as exc:
                failures += 1  # the API server may be briefly away: say so, keep polling
                log.warning("pod_list_failed", error=str(exc)[:300], consecutive=failures)
                continue
            failures = 0
            await self._notice_exits(pods)

    async def _notice_exits(self, pods: list[dict[str, Any]]) -> None:
        by_id = {wid: p for p in pods if (wid := _worker_id(p)) is not None}
        for worker_id, name in list(self.pods.items()):
            pod = by_id.get(worker_id)
            if pod is not None and _phase(pod) not in TERMINAL_PHASES:
                continue
            if self.pods.get(worker_id) != name:  # stopped by us meanwhile
                continue
            del self.pods[worker_id]
            detail = f"pod {name} deleted" if pod is None else _exit_detail(pod)
            if pod is not None:
                try:
                    await self._delete(name, grace_s=0)  # free its node's resources
                except self._api_errors as exc:  # the next provisioner start clears it
                    log.warning("failed_pod_not_deleted", pod=name, error=_api_message(exc))
            assert self._on_exit is not None
            self._on_exit(worker_id, detail)

    async def _list_pods(self) -> list[dict[str, Any]]:
        result = await self._call(
            self.api.list_namespaced_pod, self.namespace, label_selector=self.selector
        )
        return [self.api_client.sanitize_for_serialization(p) for p in result.items]

    async def _read_pod(self, name: str) -> dict[str, Any] | None:
        try:
            pod = await self._call(self.api.read_namespaced_pod, name, self.namespace)
        except self._client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        body: dict[str, Any] = self.api_client.sanitize_for_serialization(pod)
        return body

    async def _delete(self, name: str, grace_s: float) -> bool:
        """Delete a pod; False when it was not there."""
        try:
            await self._call(
                self.api.delete_namespaced_pod,
                name,
                self.namespace,
                grace_period_seconds=math.ceil(grace_s),
            )
        except self._client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """The client is synchronous: each call runs in a thread, with a timeout."""
        return await asyncio.to_thread(method, *args, _request_timeout=REQUEST_TIMEOUT, **kwargs)


def _load_configuration() -> tuple[Any, str]:
    """The client configuration and the namespace to use when none is set: in a pod, its
    service account's; elsewhere the kubeconfig's (``KUBECONFIG``, read now: the client reads
    it once, at import) and its current context's namespace."""
    from kubernetes import client
    from kubernetes import config as kube_config

    config: Any = kube_config  # untyped
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        return configuration, namespace or "default"
    config_file = os.environ.get("KUBECONFIG") or None
    config.load_kube_config(
        config_file=config_file, client_configuration=configuration, persist_config=False
    )
    _, active = config.list_kube_config_contexts(config_file=config_file)
    return configuration, (active.get("context") or {}).get("namespace") or "default"


def _urllib3_error() -> type[Exception]:
    import urllib3

    return urllib3.exceptions.HTTPError


def _worker_id(pod: dict[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(WORKER_ID_ANNOTATION)


def _phase(pod: dict[str, Any]) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def _created_at(pod: dict[str, Any]) -> float:
    stamp = (pod.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return time.time()
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def _exit_detail(pod: dict[str, Any]) -> str:
    """``pod NAME Failed: OOMKilled (exit code 137)`` from the worker container's state."""
    name = pod["metadata"]["name"]
    detail = f"pod {name} {_phase(pod)}"
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            reason = terminated.get("reason") or "terminated"
            return f"{detail}: {reason} (exit code {terminated.get('exitCode')})"
    return detail


def _api_message(exc: Any) -> str:
    """``403 Forbidden: <the API's message>``, or what the connection said."""
    if not hasattr(exc, "status"):
        return f"the API server did not answer: {exc}"
    try:
        message = json.loads(exc.body).get("message")
    except (TypeError, ValueError, AttributeError):
        message = None
    return f"{exc.status} {exc.reason}: {message or exc.body or ''}".strip()

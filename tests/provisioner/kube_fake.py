"""A minimal fake of the Kubernetes API server, for the provisioner's Kubernetes backend.

No API server can run here, so this aiohttp app on loopback implements just the endpoints the
backend calls (read a PodTemplate; list, create, read and delete pods), with the API's JSON
shapes and status codes (404 NotFound, 409 AlreadyExists), and the real ``kubernetes`` client
talks to it over HTTP through a kubeconfig. It plays the kubelet too, by hand: a test makes a
pod run, fail, or vanish. It is no model of a cluster: nothing is scheduled, no container runs.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.json_response(body, status=code)


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality selectors only (``a=b,c=d``): all the backend uses."""
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKube:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.templates: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) in order
        self.refuse_create: tuple[int, str] | None = None  # (status, reason) for the next creates
        self.refuse_delete: tuple[int, str] | None = None  # (status, reason) for the next deletes
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application(middlewares=[self._record])
        base = "/api/v1/namespaces/{ns}"
        app.router.add_get(base + "/podtemplates/{name}", self._read_template)
        app.router.add_get(base + "/pods", self._list_pods)
        app.router.add_post(base + "/pods", self._create_pod)
        app.router.add_get(base + "/pods/{name}", self._read_pod)
        app.router.add_delete(base + "/pods/{name}", self._delete_pod)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def write_kubeconfig(self, path: Path, namespace: str = "gpu") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                }
            ],
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    # -- the kubelet, by hand --------------------------------------------------------------------
    def add_template(self, namespace: str, name: str, template: dict[str, Any]) -> None:
        self.templates[(namespace, name)] = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name, "namespace": namespace},
            "template": template,
        }

    def set_phase(
        self,
        namespace: str,
        name: str,
        phase: str,
        *,
        reason: str = "",
        exit_code: int | None = None,
    ) -> None:
        pod = self.pods[(namespace, name)]
        pod["status"] = {"phase": phase}
        if exit_code is not None:
            container = pod["spec"]["containers"][0]["name"]
            pod["status"]["containerStatuses"] = [
                {
                    "name": container,
                    "ready": False,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "",
                    "state": {"terminated": {"exitCode": exit_code, "reason": reason or "Error"}},
                }
            ]

    def vanish(self, namespace: str, name: str) -> None:
        del self.pods[(namespace, name)]

    def verbs_used(self) -> set[tuple[str, str]]:
        """The (resource, RBAC verb) of every request served."""
        used = set()
        for method, path in self.requests:
            parts = path.split("/")  # "", api, v1, namespaces, NS, RESOURCE[, NAME]
            resource, named = parts[5], len(parts) > 6
            verb = {"POST": "create", "DELETE": "delete"}.get(method, "get" if named else "list")
            used.add((resource, verb))
        return used

    def pods_in(self, namespace: str) -> dict[str, dict[str, Any]]:
        return {name: pod for (ns, name), pod in self.pods.items() if ns == namespace}

    # -- the API --------------------------------------------------------------------------------
    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if request.headers.get("Authorization") != "Bearer fake-token":
            return _status(401, "Unauthorized", "no token")
        return await handler(request)

    async def _read_template(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.templates:
            return _status(404, "NotFound", f'podtemplates "{key[1]}" not found')
        return web.json_response(self.templates[key])

    async def _list_pods(self, request: web.Request) -> web.Response:
        ns, selector = request.match_info["ns"], request.query.get("labelSelector", "")
        items = [
            pod
            for (pod_ns, _), pod in sorted(self.pods.items())
            if pod_ns == ns and _matches(pod["metadata"].get("labels") or {}, selector)
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": "1"},
                "items": items,
            }
        )

    async def _create_pod(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        pod = await request.json()
        name = pod["metadata"]["name"]
        if self.refuse_create is not None:
            code, reason = self.refuse_create
            return _status(code, reason, f"pods is {reason.lower()} (fake)")
        if (ns, name) in self.pods:
            return _status(409, "AlreadyExists", f'pods "{name}" already exists')
        pod = copy.deepcopy(pod)
        pod["metadata"].update(
            namespace=ns,
            uid=f"uid-{len(self.pods)}",
            creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        pod["status"] = {"phase": "Pending"}
        self.pods[(ns, name)] = pod
        return web.json_response(pod, status=201)

    async def _read_pod(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.pods:
            return _status(404, "NotFound", f'pods "{key[1]}" not found')
        return web.json_response(self.pods[key])

    async def _delete_pod(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        if self.refuse_delete is not None:
            code, reason = self.refuse_delete
            return _status(code, reason, f"pods is {reason.lower()} (fake)")
        pod = self.pods.pop(key, None)
        if pod is None:
            return _status(404, "NotFound", f'pods "{key[1]}" not found')
        pod["metadata"]["deletionGracePeriodSeconds"] = int(
            request.query.get("gracePeriodSeconds", "30")
        )
        return web.json_response(pod)

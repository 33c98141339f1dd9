"""The contract every backend keeps: the interface, its errors and what a worker inherits.

A backend only launches and terminates workers and says when one died; what to start, when,
and whether a STOP is allowed is the service's (``service.py``) and the pool's (``pool.py``).
The backends import this module; it imports none of them (``registry.py`` picks one by name).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from shared.settings import ProvisionerSettings

# (worker id, what happened: "exit code 1", "pod Failed: OOMKilled")
OnExit = Callable[[str, str], None]
Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]


class BackendUnavailable(RuntimeError):
    """The backend cannot work here (a package missing, no cluster configuration)."""

    retryable = False


class BackendError(RuntimeError):
    """The backend could not do what was asked this time (the API server away, say)."""

    retryable = True


class LaunchError(BackendError):
    """A worker could not be launched (the API refused the pod, the process did not start)."""


class Backend(Protocol):
    name: str
    # The most workers it can host at once (the GPUs of a host); None: no limit of its own.
    capacity: int | None
    # With the auth callout: whether a worker gets its NATS credential at launch (a local
    # process, in its environment) or enrols for it once running (a pod: a credential in its
    # spec would be readable by whoever reads pods; shared/enrol.py).
    credential_at_launch: bool

    async def open(self, spawn: Spawn, on_exit: OnExit) -> dict[str, float]:
        """Get ready; ``spawn`` starts supervised tasks, ``on_exit`` is called when a worker
        dies on its own. Returns the workers already running that it takes over (id -> when
        each was created, wall clock): pods survive a provisioner restart, processes do not."""
        ...

    async def launch(self, worker_id: str, nats_url: str | None = None) -> str:
        """Start a worker with this id; returns where it runs ("pid 12 on GPU-...", "pod ...").
        ``nats_url``: the worker's own NATS URL, its credential in it (services/provisioner/
        callout.py); None: the backend's usual one. Idempotent for a worker it already runs.
        Raises :class:`LaunchError`."""
        ...

    async def terminate(self, worker_id: str, grace_s: float) -> str:
        """Stop the worker (SIGTERM, or delete its pod, with ``grace_s`` to hand off) and wait
        until it is gone; returns how it ended. A worker it does not run is already gone.
        Raises :class:`BackendError` when it could not (the caller tries again)."""
        ...

    async def close(self, grace_s: float) -> list[str]:
        """The provisioner stops: returns the workers that stop with it (local processes do;
        pods keep running and are taken over by the next provisioner)."""
        ...


def mesh_env(settings: ProvisionerSettings) -> dict[str, str]:
    """The settings a worker must share with its provisioner to be part of the same mesh (the
    subject prefix and Redis namespace; the TLS client files, at the same paths: a pod gets
    them from the same Secret; the GPU kind it emulates when one is set)."""
    env = {
        "TURBOSERVE_SUBJECT_PREFIX": settings.subject_prefix,
        "TURBOSERVE_REDIS_NAMESPACE": settings.redis_namespace,
        **(settings.tls.env() if settings.tls else {}),
    }
    if settings.emulate:
        env["TURBOSERVE_EMULATE"] = settings.emulate
    return env

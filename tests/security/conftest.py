"""A NATS and a Redis of the security tests' own, started on free ports with the users and
permissions ``turboserve up`` gives them (``Mesh(secure=True)``: the code under test)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import nats
import pytest
import redis.asyncio as aioredis

from services.provisioner.callout import Callout, WorkerCredentials
from shared.security import PROVISIONER, inbox_prefix, with_user
from shared.wire import Subjects
from tools.launcher import Mesh

PREFIX = "sec"


def secured_servers(prefix: str, tls: bool = False) -> Iterator[Mesh]:
    """NATS and Redis of their own, with a user per service, as ``turboserve up`` secures them
    (``tls``: requiring TLS too); stopped after."""
    mesh = Mesh(
        embedded="always",
        secure=True,
        tls=tls,
        quiet=True,
        env={"TURBOSERVE_SUBJECT_PREFIX": prefix, "TURBOSERVE_REDIS_NAMESPACE": prefix},
    )
    mesh.start_infra()
    yield mesh
    mesh.stop()


@pytest.fixture(scope="session")
def secure_infra() -> Iterator[Mesh]:
    yield from secured_servers(PREFIX)


def server_log(mesh: Mesh, name: str) -> str:
    """What the embedded server wrote so far (``nats`` or ``redis``)."""
    assert mesh.tmpdir is not None
    return (mesh.tmpdir / f"{name}.log").read_text(errors="replace")


@dataclass
class CalloutRunning:
    """The provisioner's auth callout answering for the workers of ``secure_infra`` (the code
    under test, as the provisioner runs it), and the credentials it checks."""

    credentials: WorkerCredentials
    mesh: Mesh

    async def login(self, worker_id: str) -> str:
        """A NATS URL for ``worker_id`` with a credential made for it, as at its launch."""
        password = await self.credentials.mint(worker_id)
        return with_user(self.mesh.secured["nats"], worker_id, password)


@pytest.fixture
async def callout(secure_infra: Mesh) -> AsyncIterator[CalloutRunning]:
    creds = secure_infra.credentials
    assert creds is not None and creds.callout is not None
    nc = await nats.connect(
        with_user(secure_infra.secured["nats"], PROVISIONER, creds.nats[PROVISIONER]),
        inbox_prefix=inbox_prefix(PROVISIONER),
    )
    redis = aioredis.from_url(
        with_user(secure_infra.secured["redis"], PROVISIONER, creds.redis[PROVISIONER])
    )
    credentials = WorkerCredentials(redis, PREFIX)
    answering = Callout(nc, creds.callout, credentials, Subjects(PREFIX))
    await answering.start()
    await nc.flush()
    try:
        yield CalloutRunning(credentials, secure_infra)
    finally:
        await answering.close()
        await nc.close()
        await redis.delete(credentials.key)
        await redis.aclose()

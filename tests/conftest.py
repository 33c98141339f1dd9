"""Shared fixtures: a real NATS (JetStream) and Redis, isolated per test by prefix/namespace.

They are the ones at TURBOSERVE_NATS_URL / TURBOSERVE_REDIS_URL (default: the standard local
ports) when those answer, otherwise embedded servers that this session starts and stops, exactly
as ``turboserve up`` would.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from tools.launcher import Mesh


@pytest.fixture(scope="session")
def infra() -> Iterator[Mesh]:
    mesh = Mesh.from_env(quiet=True)
    mesh.start_infra()
    yield mesh
    mesh.stop()


@pytest.fixture
def isolation() -> dict[str, str]:
    """A subject prefix and Redis namespace of this test's own, and a chunk stream sized for a
    test's few sessions (JetStream reserves a stream's max_bytes of the shared server's
    memory: a leftover stream of the default 64 sessions holds a gigabyte)."""
    tag = "t" + uuid.uuid4().hex[:10]
    return {
        "TURBOSERVE_SUBJECT_PREFIX": tag,
        "TURBOSERVE_REDIS_NAMESPACE": tag,
        "TURBOSERVE_STREAM_SESSIONS": "4",
    }


@pytest.fixture
async def redis_client(infra: Mesh, isolation: dict[str, str]) -> AsyncIterator[object]:
    import redis.asyncio as aioredis

    client = aioredis.from_url(infra.redis_url, socket_timeout=30)
    yield client
    ns = isolation["TURBOSERVE_REDIS_NAMESPACE"]
    keys = [k async for k in client.scan_iter(match=f"{ns}:*", count=500)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
async def nats_client(infra: Mesh, isolation: dict[str, str]) -> AsyncIterator[object]:
    import nats

    from shared.wire import Subjects

    nc = await nats.connect(infra.nats_url)
    yield nc
    subjects = Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"])
    js = nc.jetstream()
    for stream in (subjects.sessions_stream, subjects.chunks_stream):
        try:
            await js.delete_stream(stream)
        except Exception:  # noqa: BLE001 - the test may not have created it
            pass
    await nc.close()


@pytest.fixture
def env(
    infra: Mesh,
    isolation: dict[str, str],
    nats_client: object,  # deletes the test's streams after it
    redis_client: object,  # deletes the test's keys after it
) -> dict[str, str]:
    """What a service under test reads: the real NATS and Redis, this test's own subject prefix
    and Redis namespace, warnings only. A test module that needs more defines its own."""
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
    }

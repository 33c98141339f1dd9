"""A NATS and a Redis of the security tests' own, started on free ports with the users and
permissions ``turboserve up`` gives them (``Mesh(secure=True)``: the code under test)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tools.launcher import Mesh

PREFIX = "sec"


@pytest.fixture(scope="session")
def secure_infra() -> Iterator[Mesh]:
    mesh = Mesh(
        embedded="always",
        secure=True,
        quiet=True,
        env={"TURBOSERVE_SUBJECT_PREFIX": PREFIX, "TURBOSERVE_REDIS_NAMESPACE": PREFIX},
    )
    mesh.start_infra()
    yield mesh
    mesh.stop()


def server_log(mesh: Mesh, name: str) -> str:
    """What the embedded server wrote so far (``nats`` or ``redis``)."""
    assert mesh.tmpdir is not None
    return (mesh.tmpdir / f"{name}.log").read_text(errors="replace")

"""The clustered brokers of ``turboserve up --ha`` and ``turboserve chaos --ha``, on loopback:
three NATS servers as one JetStream cluster, and a Redis primary with two replicas watched by
three sentinels. :class:`tools.launcher.Mesh` starts them in place of its single servers.

- NATS: each node has its own JetStream store and ``server_name``; clients see the three as
  one ``TURBOSERVE_NATS_URL`` list, and the streams get three replicas
  (``TURBOSERVE_STREAM_REPLICAS``). The routes between nodes are mutual TLS where the clients'
  connections are (the server certificate authenticates both ends).
- Redis: every node has the services' users and the replication users
  (``shared/security.py``); the services reach the primary through the sentinels
  (``redis+sentinel://``), and a session's creation and transitions wait for one replica
  (``TURBOSERVE_REDIS_WAIT_REPLICAS``). The nodes speak plain text on loopback: the bundled
  ``redis-server`` has no TLS, and the sentinels hand clients the nodes' own addresses, so a TLS
  front per node (as ``turboserve up`` puts before its single Redis) would be bypassed.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, cast

from shared.security import (
    SENTINEL_MASTER,
    nats_cluster_config,
    redis_replica_config,
    redis_replication_users,
    redis_sentinel_config,
)
from shared.tls import Certificates, nats_tls_config
from tools.servers import (
    MeshStartError,
    free_port,
    probe_nats,
    probe_redis,
    wait_until,
    write_private,
)


class ServerHost(Protocol):
    """What starts the servers and owns them (tools/launcher.py's ``Mesh``)."""

    tmpdir: Path | None

    def abort(self) -> bool: ...

    def spawn_server(self, name: str, args: list[str], kind: str) -> subprocess.Popen[bytes]: ...

    def proc_of(self, name: str) -> subprocess.Popen[bytes]: ...


NODES = 3
# How long a sentinel waits for a silent primary before it counts it down. On loopback a
# second is plenty; across hosts, more (docs/operations.md).
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 10000


@dataclass
class RedisGroup:
    """Where the replicated Redis listens, and the passwords of its replication users."""

    nodes: list[int] = field(default_factory=list)  # node ports, the first primary at start
    sentinels: list[int] = field(default_factory=list)
    replica_password: str | None = None
    sentinel_password: str | None = None

    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
        return f"redis+sentinel://{hosts}/{SENTINEL_MASTER}/0"


def start_nats_cluster(
    mesh: ServerHost, certs: Certificates | None, base: Callable[[int, Path], str]
) -> str:
    """Three nodes of one JetStream cluster; ``base(port, store)`` is a node's config without
    its cluster block (listen address, limits, users, TLS). Returns the clients' URL list."""
    assert mesh.tmpdir is not None
    ports = [free_port() for _ in range(NODES)]
    routes = [free_port() for _ in range(NODES)]
    route_tls = nats_tls_config(certs.server_cert, certs.server_key, certs.ca_file) if certs else ""
    for i, (port, route) in enumerate(zip(ports, routes, strict=True)):
        others = [f"nats-route://127.0.0.1:{r}" for r in routes if r != route]
        text = base(port, mesh.tmpdir / f"jetstream{i + 1}") + nats_cluster_config(
            f"n{i + 1}", f"127.0.0.1:{route}", others, route_tls
        )
        conf = write_private(mesh.tmpdir / f"nats{i + 1}.conf", text)
        mesh.spawn_server(f"nats{i + 1}", ["-c", str(conf)], "nats")
    for i, port in enumerate(ports):
        proc = mesh.proc_of(f"nats{i + 1}")
        url = f"nats://127.0.0.1:{port}"
        wait_until(partial(probe_nats, url), 20, f"NATS node {i + 1}", proc, mesh.abort)
    scheme = "tls" if certs else "nats"
    return ",".join(f"{scheme}://127.0.0.1:{p}" for p in ports)


def start_redis_group(mesh: ServerHost, users: list[str], with_users: bool) -> RedisGroup:
    """A primary, two replicas and three sentinels; ``users``: the services' ``user`` lines
    (empty for an open Redis). Waits until every sentinel knows both replicas and the other
    sentinels: before that, a killed primary would have no one to fail over to."""
    assert mesh.tmpdir is not None
    group = RedisGroup(
        nodes=[free_port() for _ in range(NODES)],
        sentinels=[free_port() for _ in range(NODES)],
    )
    lines = list(users)
    if with_users:
        group.replica_password = secrets.token_urlsafe(24)
        group.sentinel_password = secrets.token_urlsafe(24)
        lines += redis_replication_users(group.replica_password, group.sentinel_password)
    primary = group.nodes[0]
    for i, port in enumerate(group.nodes):
        text = "\n".join(lines) + "\n" if lines else ""
        if i > 0:
            text += redis_replica_config("127.0.0.1", primary, group.replica_password)
        conf = write_private(mesh.tmpdir / f"redis{i + 1}.conf", text)
        mesh.spawn_server(
            f"redis{i + 1}",
            [str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(mesh.tmpdir),
             "--dbfilename", f"redis{i + 1}.rdb"],
            "redis",
        )  # fmt: skip
    for i, port in enumerate(group.sentinels):
        text = redis_sentinel_config(
            "127.0.0.1",
            port,
            "127.0.0.1",
            primary,
            group.sentinel_password,
            down_after_ms=DOWN_AFTER_MS,
            failover_timeout_ms=FAILOVER_TIMEOUT_MS,
        )
        conf = write_private(mesh.tmpdir / f"sentinel{i + 1}.conf", text)
        mesh.spawn_server(f"sentinel{i + 1}", [str(conf), "--sentinel"], "redis")
    for name, port in [
        *((f"redis{i + 1}", p) for i, p in enumerate(group.nodes)),
        *((f"sentinel{i + 1}", p) for i, p in enumerate(group.sentinels)),
    ]:
        url = f"redis://127.0.0.1:{port}"
        wait_until(partial(probe_redis, url), 20, name, mesh.proc_of(name), mesh.abort)
    deadline = time.monotonic() + 60
    while not watched(group):
        if time.monotonic() > deadline:
            raise MeshStartError("the sentinels did not learn the replicas within 60 s")
        if mesh.abort():
            raise MeshStartError("interrupted while the sentinels met the replicas")
        time.sleep(0.25)
    return group


def watched(group: RedisGroup) -> bool:
    """Every sentinel knows the primary's replicas, in sync, and the other sentinels."""
    import redis  # noqa: PLC0415

    for port in group.sentinels:
        client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
        try:
            replicas = client.sentinel_slaves(SENTINEL_MASTER)
            others = cast("list[dict[str, Any]]", client.sentinel_sentinels(SENTINEL_MASTER))
        except redis.RedisError:
            return False
        finally:
            client.close()
        up = [
            r
            for r in replicas
            if "s_down" not in r.get("flags", "") and r.get("master-link-status") == "ok"
        ]
        if len(up) < NODES - 1 or len(others) < NODES - 1:
            return False
    return True


def primary_port(group: RedisGroup) -> int | None:
    """The port of the node the sentinels name primary now (None: none answers)."""
    import redis  # noqa: PLC0415

    for port in group.sentinels:
        client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
        try:
            _, node = cast(
                "tuple[str, int]", client.sentinel_get_master_addr_by_name(SENTINEL_MASTER)
            )
            return int(node)
        except (redis.RedisError, TypeError, ValueError):
            continue
        finally:
            client.close()
    return None

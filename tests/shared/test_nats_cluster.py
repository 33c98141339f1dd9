"""A real three-node NATS JetStream cluster on free loopback ports (the machine's own NATS is
never touched): a service connects with ``TURBOSERVE_NATS_URL`` as a list of the nodes, its
streams are declared with ``TURBOSERVE_STREAM_REPLICAS`` = 3, and killing the node it is
connected to loses no acknowledged message: it reconnects to another and publishes on."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from shared.runner import connect_nats
from shared.settings import CommonSettings, SettingsError
from shared.streams import ensure_streams
from shared.wire import SessionEvent, SessionEventKind, Subjects, encode
from tests.eventually import eventually, eventually_sync
from tests.server_group import ServerGroup
from tools.servers import free_port, nats_server_binary, probe_nats

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Cluster(ServerGroup):
    def __init__(self, tmp: Path, size: int = 3) -> None:
        super().__init__()
        self.ports = [free_port() for _ in range(size)]
        routes = [free_port() for _ in range(size)]
        for i, (port, route) in enumerate(zip(self.ports, routes, strict=True)):
            others = ", ".join(f'"nats://127.0.0.1:{r}"' for r in routes if r != route)
            conf = tmp / f"n{i}.conf"
            conf.write_text(
                f'listen: "127.0.0.1:{port}"\n'
                f'server_name: "n{i}"\n'
                f'jetstream {{ store_dir: "{tmp / f"js{i}"}" }}\n'
                f'cluster {{ name: "ts-test", listen: "127.0.0.1:{route}", routes: [{others}] }}\n'
            )
            self.procs[port] = subprocess.Popen(
                [nats_server_binary(), "--config", str(conf)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        for port in self.ports:
            url = f"nats://127.0.0.1:{port}"
            eventually_sync(partial(probe_nats, url), 20, f"node {url} up")

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    nodes = Cluster(tmp_path)
    yield nodes
    nodes.stop()


def test_the_nats_url_takes_a_list_of_one_scheme_and_replicas_are_bounded():
    ok = CommonSettings.from_env({"TURBOSERVE_NATS_URL": "tls://a:4222, tls://b:4222"})
    assert ok.nats_url.startswith("tls://a")
    with pytest.raises(SettingsError, match="one scheme"):
        CommonSettings.from_env({"TURBOSERVE_NATS_URL": "tls://a:4222,nats://b:4222"})
    with pytest.raises(SettingsError, match="comma-separated"):
        CommonSettings.from_env({"TURBOSERVE_NATS_URL": "nats://a:4222,redis://b"})
    with pytest.raises(SettingsError, match="TURBOSERVE_STREAM_REPLICAS"):
        CommonSettings.from_env({"TURBOSERVE_STREAM_REPLICAS": "7"})


async def test_a_node_dies_and_no_acknowledged_message_is_lost(cluster):
    settings = CommonSettings.from_env(
        {
            "TURBOSERVE_NATS_URL": cluster.url,
            "TURBOSERVE_STREAM_REPLICAS": "3",
            "TURBOSERVE_SUBJECT_PREFIX": "ha",
            "TURBOSERVE_STREAM_SESSIONS": "4",
            "TURBOSERVE_LOG_LEVEL": "warning",
        }
    )
    subjects = Subjects("ha")
    nc = await connect_nats(settings, "ha-test")
    try:
        js = nc.jetstream()

        async def declared() -> bool:
            try:  # the cluster elects its JetStream meta leader first
                await ensure_streams(js, subjects, replicas=settings.stream_replicas)
            except Exception:  # noqa: BLE001 - not ready yet: asked again
                return False
            return True

        await eventually(declared, 30, "the R3 streams declared")
        info = await js.stream_info(subjects.sessions_stream)
        assert info.config.num_replicas == 3

        def event(i: int) -> bytes:
            return encode(
                SessionEvent(session_id=f"s{i}", kind=SessionEventKind.CREATED, prompt="p")
            )

        def once(i: int) -> dict[str, str]:  # a retried publish is stored once
            return {"Nats-Msg-Id": f"e{i}"}

        for i in range(5):
            await js.publish(subjects.session_events, event(i), headers=once(i))
        connected = nc.connected_url.port
        assert connected in cluster.ports
        cluster.kill(connected)

        acked = 5
        deadline = time.monotonic() + 30
        while acked < 10 and time.monotonic() < deadline:
            try:  # during the failover a publish may time out: it is not acknowledged then
                await js.publish(
                    subjects.session_events, event(acked), timeout=2, headers=once(acked)
                )
                acked += 1
            except Exception:  # noqa: BLE001 - asked again until the deadline
                continue
        assert acked == 10, "publishing did not resume on the surviving nodes"
        assert nc.connected_url.port != connected
        info = await js.stream_info(subjects.sessions_stream)
        assert info.state.messages == 10  # every acknowledged event is there
        assert info.cluster is not None and info.cluster.leader is not None
    finally:
        await nc.close()

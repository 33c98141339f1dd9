"""``TURBOSERVE_REDIS_URL`` in its Sentinel form, against real servers on free loopback ports
(the machine's own Redis is never touched): a primary, a replica and three sentinels. A
service's client finds the primary through the sentinels and, when the primary is killed,
follows the failover to the replica they promote; a write acknowledged by the replica
(``WAIT``) survives it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel

from shared.runner import connect_redis
from shared.settings import CommonSettings, SettingsError, mask_url, parse_sentinel_url
from tests.eventually import eventually, eventually_sync
from tests.server_group import ServerGroup
from tools.servers import free_port, probe_redis, redis_server_binary

MASTER = "tsmaster"


def test_the_sentinel_form_is_parsed_and_checked():
    target = parse_sentinel_url("redis+sentinel://svc:s3cret@10.0.0.1:26379,sent-2:26380/ts/2")
    assert target is not None
    assert target.sentinels == (("10.0.0.1", 26379), ("sent-2", 26380))
    assert (target.master, target.db, target.username, target.password, target.tls) == (
        "ts",
        2,
        "svc",
        "s3cret",
        False,
    )
    tls = parse_sentinel_url("rediss+sentinel://h:1/ts")
    assert tls is not None and tls.tls and tls.db == 0
    assert parse_sentinel_url("redis://h:6379/0") is None
    assert "s3cret" not in mask_url("redis+sentinel://svc:s3cret@h:1,h:2/ts/0")
    for bad in ("redis+sentinel://h/ts/0", "redis+sentinel://h:1/", "redis+sentinel://h:1/ts/x"):
        with pytest.raises(SettingsError, match="TURBOSERVE_REDIS_URL"):
            CommonSettings.from_env({"TURBOSERVE_REDIS_URL": bad})


class Replicated(ServerGroup):
    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.tmp = tmp
        self.primary, self.replica = free_port(), free_port()
        self.sentinels = [free_port() for _ in range(3)]
        self._redis(self.primary)
        self._redis(self.replica, "--replicaof", "127.0.0.1", str(self.primary))
        for port in self.sentinels:
            conf = tmp / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {tmp}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
            )
            self._start(port, [str(conf), "--sentinel"])
        for port in [self.primary, self.replica, *self.sentinels]:
            url = f"redis://127.0.0.1:{port}"
            eventually_sync(partial(probe_redis, url), 20, f"{url} up")
        eventually_sync(self._in_sync, 20, "the replica in sync with the primary")
        # A sentinel learns the replica from the primary's INFO (every 10 s) and the other
        # sentinels from their hellos: until then a killed primary has no one to fail over to.
        eventually_sync(self._watched, 40, "every sentinel knowing the replica and the others")

    def _watched(self) -> bool:
        import redis

        for port in self.sentinels:
            client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
            try:
                replicas = client.execute_command("SENTINEL", "REPLICAS", MASTER)
                others = client.execute_command("SENTINEL", "SENTINELS", MASTER)
            except redis.RedisError:
                return False
            finally:
                client.close()
            if len(replicas) < 1 or len(others) < len(self.sentinels) - 1:
                return False
        return True

    def _in_sync(self) -> bool:
        import redis

        client = redis.Redis(port=self.replica, socket_timeout=1)
        try:
            return client.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _redis(self, port: int, *args: str) -> None:
        self._start(
            port,
            ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.tmp), "--dbfilename", f"dump-{port}.rdb", *args],
        )  # fmt: skip

    def _start(self, port: int, args: list[str]) -> None:
        self.procs[port] = subprocess.Popen(
            [redis_server_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER}/0"


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Replicated]:
    servers = Replicated(tmp_path)
    yield servers
    servers.stop()


@pytest.mark.integration
@pytest.mark.slow
async def test_a_service_follows_the_failover_and_keeps_what_the_replica_had(replicated):
    settings = CommonSettings.from_env({"TURBOSERVE_REDIS_URL": replicated.url})
    client = await connect_redis(settings)
    try:
        await client.set("ts:kept", "1")
        assert await client.execute_command("WAIT", 1, 5000) == 1  # the replica has it
        replicated.kill(replicated.primary)

        deadline = time.monotonic() + 40
        written = False
        while not written and time.monotonic() < deadline:
            try:  # until the sentinels promote the replica
                await client.set("ts:after", "2")
                written = True
            except Exception:  # noqa: BLE001 - the old primary is gone: asked again
                await _pause()
        assert written, "no write succeeded after the primary was killed"
        assert await client.get("ts:kept") == b"1"
        sentinel = Sentinel([("127.0.0.1", p) for p in replicated.sentinels])

        async def promoted() -> bool:
            try:  # a sentinel may still be catching up with the failover
                return await sentinel.discover_master(MASTER) == ("127.0.0.1", replicated.replica)
            except MasterNotFoundError:
                return False

        await eventually(promoted, 10, "the sentinels naming the replica the master")
    finally:
        await client.aclose()


async def _pause() -> None:
    import asyncio

    await asyncio.sleep(0.5)


@pytest.mark.integration
@pytest.mark.slow
async def test_registry_writes_wait_for_a_replica_and_go_on_without_one(replicated):
    """With ``TURBOSERVE_REDIS_WAIT_REPLICAS`` 1, a session's creation and its transitions, and
    a meter's run opened and closed, are on the replica when they return; with the replica gone
    they still succeed, after the wait, and say so."""
    import redis.asyncio as aioredis

    from shared.meter import Meter
    from shared.registry import Registry
    from shared.states import SessionState

    settings = CommonSettings.from_env(
        {
            "TURBOSERVE_REDIS_URL": replicated.url,
            "TURBOSERVE_REDIS_WAIT_REPLICAS": "1",
            "TURBOSERVE_REDIS_WAIT_MS": "300",
        }
    )
    client = await connect_redis(settings)
    replica = aioredis.from_url(f"redis://127.0.0.1:{replicated.replica}")
    try:
        registry = Registry(client, "ts", settings.redis_wait_replicas, settings.redis_wait_ms)
        await registry.create_session("s1", "p", 1)
        moved = await registry.claim("s1", "w1", expected_epoch=0)
        # read from the replica itself, at once: it has both writes
        assert await replica.hget(registry.session_key("s1"), "owner") == b"w1"
        assert int(await replica.hget(registry.session_key("s1"), "epoch")) == moved.epoch

        meter = Meter(client, "ts", settings.redis_wait_replicas, settings.redis_wait_ms)
        await meter.open("w1", at=100.0)
        assert await replica.hget(meter.open_key, "w1") == b"100.0"
        assert await meter.close("w1", at=130.0) == 30.0
        assert await replica.hget(meter.open_key, "w1") is None
        assert float(await replica.get(meter.total_key)) == 30.0

        replicated.kill(replicated.replica)
        started = time.monotonic()
        record = await registry.transition("s1", SessionState.SUSPENDED, expected_epoch=moved.epoch)
        assert record.state is SessionState.SUSPENDED
        assert time.monotonic() - started >= 0.25  # it waited for the replica, then went on
        started = time.monotonic()
        assert await meter.open("w2") > 0
        assert time.monotonic() - started >= 0.25
    finally:
        await replica.aclose()
        await client.aclose()


@pytest.mark.integration
@pytest.mark.slow
async def test_two_owners_never_both_write_across_a_failover(replicated):
    """Owner A holds a session at epoch e, its claim waited for the replica; the primary is
    killed and the replica promoted; owner B takes the session over (a new epoch, by the
    compare-and-set). On the new primary A's writes at e are refused and B's go through, and
    the epoch A's claim was acknowledged at was not lost."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from shared.registry import Registry, StaleEpoch
    from shared.states import SessionState

    settings = CommonSettings.from_env(
        {
            "TURBOSERVE_REDIS_URL": replicated.url,
            "TURBOSERVE_REDIS_WAIT_REPLICAS": "1",
            "TURBOSERVE_REDIS_WAIT_MS": "300",
        }
    )
    # Two services, each with its own client following the sentinels.
    client_a, client_b = await connect_redis(settings), await connect_redis(settings)
    try:
        a = Registry(client_a, "ts", settings.redis_wait_replicas, settings.redis_wait_ms)
        b = Registry(client_b, "ts", settings.redis_wait_replicas, settings.redis_wait_ms)
        created = await a.create_session("s", "p", 1)
        held = await a.claim("s", "A", expected_epoch=created.epoch)
        assert await a.record_progress("s", "A", held.epoch, 0)
        replica = aioredis.from_url(f"redis://127.0.0.1:{replicated.replica}")
        try:  # A's claim returned once the replica had it
            assert await replica.hget(a.session_key("s"), "owner") == b"A"
        finally:
            await replica.aclose()

        replicated.kill(replicated.primary)
        found = None
        deadline = time.monotonic() + 40
        while found is None and time.monotonic() < deadline:
            try:  # until the sentinels promote the replica and B's client finds it
                found = await b.get_session("s")
                await client_b.set("ts:probe", "1")  # a write: the new primary, not a replica
            except Exception:  # noqa: BLE001 - the old primary is gone: asked again
                found = None
                await _pause()
        assert found is not None, "no primary after the failover"
        # The acknowledged epoch change is on the new primary.
        assert (found.owner, found.epoch, found.state) == ("A", held.epoch, SessionState.EXECUTING)

        # B takes it over as a scheduler does from a lost owner: back to pending, then its own.
        requeued = await b.transition(
            "s", SessionState.PENDING, expected_epoch=held.epoch, owner=None
        )
        taken = await b.claim("s", "B", expected_epoch=requeued.epoch)
        assert taken.owner == "B" and taken.epoch > held.epoch

        # A, at its old epoch, through its own client (which followed the failover too).
        async def refused_to_a() -> bool:
            try:
                return not await a.record_progress("s", "A", held.epoch, 1)
            except RedisError:  # A's client still on its way to the new primary
                return False

        await eventually(refused_to_a, 20, "A's progress refused")
        with pytest.raises(StaleEpoch):
            await a.transition("s", SessionState.SUSPENDED, expected_epoch=held.epoch)
        with pytest.raises(StaleEpoch):
            await a.transition("s", SessionState.PENDING, expected_epoch=held.epoch, owner=None)
        with pytest.raises(StaleEpoch):
            await a.claim("s", "A", expected_epoch=held.epoch)

        assert await b.record_progress("s", "B", taken.epoch, 1)
        suspended = await b.transition(
            "s", SessionState.SUSPENDED, expected_epoch=taken.epoch, bump_epoch=False
        )
        assert suspended.owner == "B" and suspended.epoch == taken.epoch

        # As the promoted replica itself has it: B's, never A's.
        promoted = aioredis.from_url(f"redis://127.0.0.1:{replicated.replica}")
        try:
            raw = await promoted.hgetall(a.session_key("s"))
        finally:
            await promoted.aclose()
        assert raw[b"owner"] == b"B" and int(raw[b"epoch"]) == taken.epoch
        assert raw[b"state"] == b"suspended" and int(raw[b"last_seq"]) == 1
        assert (await a.placement()) == {"s": "B"}
    finally:
        await client_a.aclose()
        await client_b.aclose()

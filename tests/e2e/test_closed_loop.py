"""The closed loop live: the mesh as `turboserve up` runs it (scheduler with the policy core,
provisioner with the local backend, CPU workers emulating the default profile's GPU), driven by
`turboserve replay`'s engine with real SSE clients.

A burst of sessions arrives -> the scheduler asks for more workers -> they boot -> sessions
migrate onto them -> the sessions leave -> the scheduler consolidates (migrations) and releases
the emptied workers (drain before scale-in)."""

from __future__ import annotations

import pytest

from shared.registry import Registry
from tests.eventually import eventually
from tools.launcher import Mesh
from tools.replay import ReplayConfig, replay
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY, OPERATOR_KEY = "test-api-key-0123456789", "test-operator-key-0123456789"


@pytest.fixture
def loop_mesh(infra, isolation, nats_client):
    m = Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=1,
        embedded="never",
        quiet=True,
        env={
            **isolation,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_EMULATE": "H20",
            "TURBOSERVE_MAX_WORKERS": "3",
            "TURBOSERVE_API_KEYS": f"test:{API_KEY}",
            "TURBOSERVE_OPERATOR_KEY": OPERATOR_KEY,
            "TURBOSERVE_TICK_S": "0.25",
        },
    )
    m.start(ready_timeout=120)
    yield m
    m.stop()


def burst(sessions: int, hold_s: float) -> list[tuple[float, str, str]]:
    events = [(0.2 * i, f"s{i}", "arrive") for i in range(sessions)]
    events += [(hold_s + 0.3 * i, f"s{i}", "depart") for i in range(sessions)]
    return sorted(events)


async def test_burst_scales_out_rebalances_then_consolidates_and_releases(
    loop_mesh, redis_client, isolation
):
    registry = Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])

    async def first_worker_seen() -> bool:
        status = await registry.scheduler_status()
        return status is not None and status.get("ready", 0) >= 1

    await eventually(first_worker_seen, 60, "the scheduler seeing the first worker", interval=0.5)
    initial = {w.id for w in await registry.workers() if w.alive}
    config = ReplayConfig(
        gateway=loop_mesh.gateway_url,
        api_key=API_KEY,
        operator_key=OPERATOR_KEY,
        speed=1.0,
        drain_s=5.0,
    )
    result = await replay(burst(16, 30.0), config)

    # Every viewer got consecutive chunks; nothing lost, repeated or restarted.
    assert result["sessions"] == 16 and result["refused"] == 0
    assert result["chunks_lost"] == 0 and result["seq_repeats"] == 0
    assert result["restarts"] == 0
    assert result["chunks"] > 16 * 10
    # The pool grew and shrank, with migrations both ways.
    assert result["scale_out_events"] >= 1 and result["peak_gpus"] >= 2
    events = await registry.cluster_events(1000)
    grown = {e["worker_id"] for e in events if e["kind"] == "scale_out"} - initial
    moves = [e for e in events if e["kind"] == "migration" and e["ok"]]
    assert any(m["dst"] in grown for m in moves), (
        f"no session moved onto a new worker ({sorted(grown)}); events, newest first: "
        f"{[{k: v for k, v in e.items() if k not in ('at', 'command_id')} for e in events]}"
    )
    # The pool goes back to its minimum, releasing only emptied workers.

    async def back_to_one() -> tuple[list[dict[str, object]], list[str]]:
        status = await registry.scheduler_status()
        live = [w for w in await registry.workers() if w.alive]
        events = await registry.cluster_events(1000)
        released = [e["worker_id"] for e in events if e["kind"] == "scale_in"]
        assert status is not None and status["gpus"] == 1 and len(live) == 1 and released, (
            f"the pool stays at {status and status['gpus']} ({len(live)} live workers)"
        )
        return events, released

    events, released = await eventually(
        back_to_one, 90, "the pool back to its minimum", interval=1.0
    )
    consolidations = [
        e for e in events if e["kind"] == "migration" and e["ok"] and e["src"] in released
    ]
    assert consolidations, "no session was moved off a worker before its release"
    for gpu in released:
        # Every session ever placed on a released worker left it before the release: none of
        # them was restarted (asserted above) and the registry holds none on it.
        assert gpu not in (await registry.placement()).values()

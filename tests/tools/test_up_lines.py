"""What `turboserve up` says: the model its workers run, what Ctrl-C stopped, and what it
found of an earlier run in a Redis it reuses (settled before any service starts)."""

from __future__ import annotations

import time

import pytest

from services.gateway.store import Activity, GatewayStore
from shared.registry import Registry
from shared.settings import ToolSettings
from shared.states import SessionState
from tools.earlier_run import EarlierSessions, settle_earlier_sessions
from tools.launcher import Mesh, banner, model_line, stopped_line


def test_the_banner_names_the_model() -> None:
    with_model = ToolSettings.from_env({"TURBOSERVE_MODEL": "/models/Wan2.1-T2V-1.3B"})
    text = banner("http://h:1", Mesh(), None, None, None, model=model_line(with_model))
    assert "Model: /models/Wan2.1-T2V-1.3B (TURBOSERVE_MODEL)" in text.splitlines()
    stand_in = model_line(ToolSettings.from_env({"TURBOSERVE_PRESET": "small"}))
    assert "stand-in" in stand_in and "'small'" in stand_in


def test_the_stopped_line_says_what_was_stopped() -> None:
    line = stopped_line({"gateway": 0, "provisioner": 0, "scheduler": -15})
    assert line.startswith("stopped gateway, provisioner, scheduler (exit -15)")
    assert stopped_line({}) == "stopped (nothing was running)"


def test_the_earlier_sessions_line() -> None:
    assert EarlierSessions().line(60, 600) is None
    line = EarlierSessions(4, 1, 2, 1).line(60, 600)
    assert line is not None
    assert "found 4 from an earlier run" in line and "closed 1" in line and "(660 s)" in line
    assert "2 idle until watched again" in line and "1 kept" in line


@pytest.mark.integration
async def test_an_earlier_runs_sessions_are_settled_by_their_lifetimes(
    infra, isolation, redis_client
) -> None:
    ns = isolation["TURBOSERVE_REDIS_NAMESPACE"]
    store, registry = GatewayStore(redis_client, ns), Registry(redis_client, ns)
    now = time.time()
    ages = {"ancient": 1000.0, "stale": 100.0, "recent": 5.0, "watched": 1000.0, "paused": 100.0}
    for sid, age in ages.items():
        await registry.create_session(sid, "p", 0)
        await store.track(sid, now=now - age)
    await store.flip("paused", (Activity.ACTIVE,), Activity.PAUSED)
    # A viewer on a gateway replica alive now (another mesh on the same namespace): kept.
    await store.replica_alive("alive-replica", ttl_s=30.0, now=now)
    await store.attach("watched", "a1", "alive-replica", now=now - 1000)
    found = await settle_earlier_sessions(infra.redis_url, ns, 60.0, 600.0, now=now)
    assert found == EarlierSessions(found=5, closed=1, idled=2, kept=2)
    ancient = await registry.get_session("ancient")
    assert ancient is not None and ancient.state is SessionState.TERMINATED
    assert "ancient" not in await store.tracked()
    activity = await store.activities(["stale", "recent", "watched", "paused"])
    assert activity == [Activity.IDLE, Activity.ACTIVE, Activity.ACTIVE, Activity.PAUSED]
    assert await registry.unwatched(["stale", "recent", "watched", "paused"]) == {
        "stale",
        "paused",
    }

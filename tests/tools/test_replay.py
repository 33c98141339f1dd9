"""The replay's own logic: the trace window, and counting what viewers saw."""

from __future__ import annotations

import pytest

from lab.sim.traceio import TraceEvent
from lab.sim.viewer import ServiceLedger
from tools.replay import (
    ReplayConfig,
    SessionLog,
    format_result,
    select_events,
    step_summary,
    summarize,
)

EVENTS = [
    TraceEvent(0.0, "a", "arrive"),
    TraceEvent(5.0, "b", "arrive"),
    TraceEvent(8.0, "a", "idle"),
    TraceEvent(12.0, "a", "active"),
    TraceEvent(20.0, "b", "depart"),
    TraceEvent(30.0, "a", "depart"),
]


def config(speed: float = 1.0, **kw) -> ReplayConfig:
    return ReplayConfig(gateway="http://x", api_key=None, operator_key=None, speed=speed, **kw)


def test_the_window_is_retimed_and_sessions_still_there_depart_at_its_end():
    assert select_events(EVENTS, config()) == [(e.t, e.session_id, e.event) for e in EVENTS]
    window = select_events(EVENTS, config(offset_s=4.0, duration_s=10.0))
    # "a" arrived before the window: left out; "b" still there at its end: departs then.
    assert window == [(1.0, "b", "arrive"), (1.0, "b", "depart")]
    assert [e for e in select_events(EVENTS, config(max_sessions=1)) if e[1] == "b"] == []


def test_a_viewer_counts_lateness_startup_and_a_spell_that_ended_waiting():
    log = SessionLog("a", ServiceLedger(period_s=1.0, deadline_ms=1000.0))
    log.id = "x"
    log.activate(100.0)
    log.chunk(0, due_at=100.0, done_at=100.4, now=100.41)  # first of the spell: 400 ms startup
    log.chunk(1, due_at=101.0, done_at=100.9, now=100.91)  # on time
    log.chunk(2, due_at=102.0, done_at=104.5, now=104.5)  # 2.5 s late: 3 periods missed
    log.deactivate(104.6)  # the next chunk was not yet due: nothing owed
    assert log.ledger.on_time == 2 and log.ledger.missed_periods == 3
    log.activate(110.0)
    log.deactivate(113.5)  # nothing came in 3.5 s: 2.5 s past the deadline -> 3 periods
    result = summarize([log], 1000.0, None, None, 0, 14.0)
    assert result["stall_s"]["max"] == pytest.approx(2.59)  # 100.91 -> 104.5, less a period
    assert result["chunks"] == 3 and result["chunks_lost"] == 0 and result["seq_repeats"] == 0
    assert result["missed_periods"] == 6
    assert result["missed_periods_at_start"] == 3  # the second spell's
    assert result["missed_periods_after_migration"] == 0
    assert result["startup_ms"]["max"] == pytest.approx(400.0)
    assert result["stall_adjusted_attainment"] == round(2 / (2 + 6), 6)
    assert result["cost_gpu_seconds"] is None  # no operator key, no account
    # The wait beyond a period (a spell with no chunk at all is startup, not a stall).
    assert result["stall_spans"] == [[100.91, 104.5, 2.59]]


def test_a_chunk_that_arrives_after_the_pause_is_counted_apart_not_as_service():
    """The worker suspends at a chunk boundary, so a chunk already under way still arrives after
    the viewer paused. Nobody watches it: it is neither a period served nor a missed one (the
    simulator voids a chunk in flight when its session goes idle), and it is counted apart."""
    log = SessionLog("a", ServiceLedger(period_s=1.0, deadline_ms=1000.0))
    log.id = "x"
    log.activate(100.0)
    log.chunk(0, due_at=100.0, done_at=100.4, now=100.41)
    log.deactivate(101.0)
    log.chunk(1, due_at=101.4, done_at=104.0, now=104.01)  # late, but the viewer is away
    log.activate(110.0)
    log.chunk(2, due_at=110.0, done_at=110.5, now=110.51)  # the new spell's first chunk
    result = summarize([log], 1000.0, None, None, 0, 12.0)
    assert result["chunks"] == 2 and result["chunks_after_pause"] == 1
    assert result["missed_periods"] == 0 and result["stall_adjusted_attainment"] == 1.0
    assert result["chunks_lost"] == 0 and result["seq_repeats"] == 0  # its seq still counts
    assert result["startup_ms"]["max"] == pytest.approx(500.0)


def test_gaps_and_repeats_are_counted():
    log = SessionLog("a", ServiceLedger(period_s=1.0, deadline_ms=1000.0))
    log.id = "x"
    for seq in (0, 1, 3, 3, 4):
        log.chunk(seq, due_at=0.0, done_at=0.0, now=0.0)
    result = summarize(
        [log],
        1000.0,
        {"counters": {"migrations": 2}, "cost": {"gpu_seconds": 5}},
        {"counters": {"migrations": 5, "scale_out_events": 1}, "cost": {"gpu_seconds": 65.5}},
        3,
        10.0,
    )
    assert result["chunks_lost"] == 1 and result["seq_repeats"] == 1 and result["seq_gaps"] == 1
    assert result["lost_sessions"] == [{"trace_id": "a", "id": "x", "seqs": [2]}]
    assert result["migrations"] == 3 and result["scale_out_events"] == 1
    assert result["cost_gpu_seconds"] == 60.5 and result["peak_gpus"] == 3


def test_an_owner_change_without_a_state_event_is_a_silent_restart():
    log = SessionLog("a", ServiceLedger(period_s=1.0, deadline_ms=1000.0))
    log.owner(1)
    log.owner(1)
    log.announced = True  # "migrated" came
    log.owner(3)
    assert log.silent_restarts == 0
    log.owner(5)  # a new owner nobody announced
    assert log.silent_restarts == 1
    log.owner(None)  # a gateway that does not say: nothing to check
    assert log.silent_restarts == 1


def test_the_simulator_plays_the_same_window_at_the_same_speed():
    from shared.profile import load_profile
    from tools.replay import compare_with_sim

    # 20 sessions over 200 trace seconds, played 10x faster: 20 s of wall time.
    events = [(10.0 * i, f"s{i}", "arrive") for i in range(20)]
    events += [(10.0 * i + 30.0, f"s{i}", "depart") for i in range(20)]
    events.sort()
    status = {
        "profiles": {"H20": load_profile().to_dict()},
        "gpu_kind": "H20",
        "policy": "least_loaded",
        "boot_delay_s": 5.0,
        "tick_s": 0.5,
    }
    before = {
        "scheduler": status,
        "pool": {"min_workers": 1, "max_workers": 4},
        "workers": [{"alive": True, "status": "ready"}],
    }
    result = {
        "_before": before,
        "wall_s": 23.0,
        "sessions": 20,
        "chunks": 100,
        "cost_gpu_seconds": 23.0,
        "latency_ms": {"p50": 0.0, "p99": 0.0, "max": 0.0},
    }
    compare_with_sim(result, events, config(speed=10.0))
    sim = result["sim"]
    assert sim["sessions"] == 20  # every session of the window, compressed into the run
    # each plays 3 s of wall time at the 1.25 s period: two or three chunks, not thirty
    assert 20 * 2 <= sim["chunks"] <= 20 * 3


def test_misses_right_after_a_migration_are_told_apart():
    log = SessionLog("a", ServiceLedger(period_s=1.0, deadline_ms=1000.0))
    log.id = "x"
    log.activate(100.0)
    log.chunk(0, due_at=100.0, done_at=100.4, now=100.4)
    log.moved = True  # a `migrated` notice
    log.chunk(1, due_at=101.0, done_at=101.5, now=101.5)  # 500 ms late: 1 period, after it
    log.chunk(2, due_at=102.5, done_at=103.0, now=103.0)  # late too, but not right after it
    result = summarize([log], 1000.0, None, None, 0, 4.0)
    assert result["missed_periods"] == 2 and result["missed_periods_after_migration"] == 1


async def test_compare_sim_waits_for_the_schedulers_account_and_says_when_none_comes():
    """A mesh that has just come up may not have a leader or a worker yet: the replay waits
    for the scheduler's account before it plays, instead of failing after the whole run."""
    import time

    import aiohttp
    from aiohttp import web

    from tools.replay import Gateways, ReplayError, _await_account, _cluster
    from tools.servers import free_port

    served_from = time.monotonic() + 1.0
    account = {"scheduler": {"profiles": {"H20": {}}}, "workers": []}

    async def cluster(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer op":
            return web.json_response({"error": "unauthorized"}, status=401)
        if time.monotonic() < served_from:
            return web.json_response({"scheduler": None, "workers": []})
        return web.json_response(account)

    app = web.Application()
    app.router.add_get("/v1/cluster", cluster)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}"
            cfg = ReplayConfig(
                gateway=url, api_key=None, operator_key="op", speed=1.0, account_wait_s=10.0
            )
            http = Gateways(session, [url])
            first = await _cluster(http, cfg)
            assert first is not None and not first["scheduler"]
            assert await _await_account(http, cfg, first) == account
            served_from = time.monotonic() + 60.0  # never again within the wait
            short = ReplayConfig(
                gateway=url, api_key=None, operator_key="op", speed=1.0, account_wait_s=1.0
            )
            started = time.monotonic()
            with pytest.raises(ReplayError, match="no scheduler account after 1 s"):
                await _await_account(http, short, await _cluster(http, short))
            assert time.monotonic() - started < 5.0
    finally:
        await runner.cleanup()


def test_chunks_at_fewer_steps_are_counted_apart_and_placed_in_time():
    log = SessionLog("a", ServiceLedger(period_s=1.0, deadline_ms=1000.0))
    log.id = "x"
    log.activate(100.0)
    log.chunk(0, due_at=100.0, done_at=100.4, now=100.41, steps=4)  # first: 400 ms startup
    log.chunk(1, due_at=101.0, done_at=100.9, now=100.91, steps=3)  # on time, fewer steps
    log.chunk(2, due_at=102.0, done_at=104.5, now=104.5, steps=2)  # late, fewer steps
    log.chunk(3, due_at=105.5, done_at=115.2, now=115.2, steps=4)  # late at full steps
    log.deactivate(115.3)
    steps = step_summary([log], started_wall=99.0)
    assert steps["full_steps"] == 4
    assert steps["by_steps"] == {"2": 1, "3": 1, "4": 2}
    assert (steps["on_time_full"], steps["on_time_reduced"], steps["late"]) == (1, 1, 2)
    assert steps["reduced_pct"] == 50.0
    assert steps["last_reduced_s"] == pytest.approx(5.5)  # 104.5 - 99.0
    assert steps["timeline"] == [
        {"t_s": 0.0, "chunks": 3, "reduced": 2, "late": 1},
        {"t_s": 10.0, "chunks": 1, "reduced": 0, "late": 1},
    ]
    result = summarize([log], 1000.0, None, None, 0, 16.0)
    result["steps"] = steps
    assert "1 / 1, 2 (last at fewer steps: 5.5 s)" in format_result(result)


def test_a_run_whose_workers_say_nothing_of_steps_has_no_step_figures():
    log = SessionLog("a", ServiceLedger(period_s=1.0, deadline_ms=1000.0))
    log.id = "x"
    log.activate(100.0)
    log.chunk(0, due_at=100.0, done_at=100.4, now=100.41)
    assert step_summary([log], started_wall=99.0) == {}

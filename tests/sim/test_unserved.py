"""Chunks that are due but never generated still count (evaluation.md: latency runs from due to
generated; a chunk never generated is late by at least the time it waited)."""

from __future__ import annotations

import json

from services.cli import main
from services.scheduler.core.profile import load_profile
from services.scheduler.core.types import Assign, EventKind, Migrate, Release, RequestGpus
from services.scheduler.sim.simulator import Simulator, simulate
from services.scheduler.sim.traceio import make_trace, write_trace


def _crowd(n: int, until: float):
    ev = []
    for i in range(n):
        ev += [(0.0, f"s{i:02d}", "arrive"), (until, f"s{i:02d}", "depart")]
    return make_trace(f"crowd{n}", ev)


def test_no_gpu_at_all_is_one_late_chunk_per_session_not_full_attainment():
    trace = make_trace("one", [(0.0, "a", "arrive"), (10.0, "a", "depart")])
    r = simulate(trace, "round_robin", gpus=0)
    assert r.chunks == 1 and r.unserved_chunks == 1
    assert r.deadline_attainment == 0.0
    assert r.latency()["max"] == 10000.0


def test_sim_run_with_zero_gpus_reports_the_starved_session(tmp_path, capsys):
    path = write_trace(make_trace("one", [(0.0, "a", "arrive"), (10.0, "a", "depart")]),
                       tmp_path / "one.csv")
    out = tmp_path / "r.json"
    assert main(["sim", "run", "--trace", str(path), "--policy", "round_robin", "--gpus", "0",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["chunks"] == 1 and doc["deadline_attainment"] == 0.0
    assert doc["latency_ms"]["max"] == 10000.0 and doc["unserved_chunks"] == 1


def test_sessions_starved_by_a_full_gpu_count_with_their_whole_wait():
    # 15 sessions on one GPU of capacity 12: round robin puts 3 beyond what ever gets served
    # in time; each waits the full 60 s and departs without a chunk.
    r = simulate(_crowd(15, 60.0), "round_robin", gpus=1)
    assert r.unserved_chunks >= 3
    assert r.latency()["max"] == 60000.0
    starved = sorted(r.latencies_ms)[-3:]
    assert starved == [60000.0, 60000.0, 60000.0]


def test_a_session_that_goes_idle_after_waiting_past_the_deadline_is_late_once():
    # No GPU: "a" waits 3 s then goes idle (late, counted), comes back and goes idle after
    # 1 s (below the deadline: the chunk might still have been on time, not counted).
    trace = make_trace("idle", [(0.0, "a", "arrive"), (3.0, "a", "idle"), (5.0, "a", "active"),
                                (6.0, "a", "idle"), (8.0, "a", "depart")])
    r = simulate(trace, "round_robin", gpus=0)
    assert r.latencies_ms == [3000.0]
    assert r.first_chunk_latencies_ms == [3000.0]


class _AllOnOneGpu:
    name = "all_on_one"

    class view:  # noqa: N801 - the attribute the simulator reads
        gpus = {"g0": None}

    def step(self, event):
        if event.kind is EventKind.ARRIVE:
            return [Assign(event.session_id, "g0")]
        return []


def test_trace_end_counts_sessions_in_flight_that_already_waited_past_the_deadline():
    # 30 sessions in one batch: a chunk takes longer than the deadline, so at the end of the
    # trace every session has a chunk in flight that has waited past it.
    profile = load_profile()
    assert profile.chunk_ms(30) > profile.deadline_ms
    seen = 0
    for tenth in range(100, 130):  # trace ends at 10.0-12.9 s, at various phases of a chunk
        trace = make_trace("crowd_end", [(0.0, f"s{i:02d}", "arrive") for i in range(30)]
                           + [(tenth / 10, "z", "arrive")])
        sim = Simulator(trace, _AllOnOneGpu(), profile)
        result = sim.run()
        end = trace.duration
        late_in_flight = [s for s in sim.sessions.values()
                          if s.active and s.in_flight is not None
                          and (end - s.due) * 1000.0 > profile.deadline_ms]
        for s in late_in_flight:
            assert (end - s.due) * 1000.0 in result.latencies_ms
        assert result.unserved_chunks == len(late_in_flight)
        seen += len(late_in_flight)
    assert seen, "the scenario must leave late chunks in flight at some trace end"


class _Scripted:
    """t=0: s1 on g0. First TICK: move s1 to g1, release g0 mid-pass, ask for g2."""

    name = "scripted"

    class view:  # noqa: N801 - the attribute the simulator reads
        gpus = {"g0": None, "g1": None}

    def __init__(self):
        self.ticked = False

    def step(self, event):
        if event.kind is EventKind.ARRIVE:
            return [Assign(event.session_id, "g0" if event.session_id == "s1" else "g1")]
        if event.kind is EventKind.TICK and not self.ticked:
            self.ticked = True
            return [Migrate("s1", "g0", "g1"), Release("g0"), RequestGpus(("g2",), "h20")]
        return []


def test_a_releasing_gpu_counts_in_peak_and_timeline_until_its_last_pass_ends():
    trace = make_trace("rel", [(0.0, "s1", "arrive"), (0.5, "z", "arrive"),
                               (5.0, "s1", "depart"), (5.0, "z", "depart")])
    profile = load_profile()
    sim = Simulator(trace, _Scripted(), profile, boot_delay_s=30.0)
    r = sim.run()
    g0 = sim.gpus["g0"]
    assert g0.released_at is not None and g0.released_at > 1.0  # its pass ran past the TICK
    assert r.peak_gpus == 3  # g0 still running while g1 holds s1 and g2 boots
    held = [(t, n) for t, n, _ in r.timeline]
    assert (1.0, 3) in held
    assert (g0.released_at, 2) in held

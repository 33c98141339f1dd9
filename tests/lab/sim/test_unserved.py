"""Chunks that are due but never generated still count: each chunk period an active session
waits past its allowance is a missed period (``sim/viewer.py``), so a session starved of a GPU
shows in the stall-adjusted attainment even though it delivered no chunk at all."""

from __future__ import annotations

import json
import math

from lab.sim.simulator import Simulator, simulate
from lab.sim.traceio import make_trace, write_trace
from services.scheduler.core.types import Assign, EventKind, Migrate, Release, RequestGpus
from shared.profile import load_profile
from tools.cli import main

PROFILE = load_profile()  # deadline = chunk period = 1,250 ms


def _crowd(n: int, until: float):
    ev = []
    for i in range(n):
        ev += [(0.0, f"s{i:02d}", "arrive"), (until, f"s{i:02d}", "depart")]
    return make_trace(f"crowd{n}", ev)


def test_no_gpu_at_all_misses_every_period_past_the_deadline():
    # 10 s without a GPU: 10,000 - 1,250 ms past the startup allowance, ceil(8750 / 1250) = 7.
    trace = make_trace("one", [(0.0, "a", "arrive"), (10.0, "a", "depart")])
    r = simulate(trace, "round_robin", gpus=0)
    assert r.chunks == 0 and r.unserved_chunks == 1 and r.missed_periods == 7
    assert r.stall_adjusted_attainment == 0.0


def test_sim_run_with_zero_gpus_reports_the_starved_session(tmp_path, capsys):
    path = write_trace(
        make_trace("one", [(0.0, "a", "arrive"), (10.0, "a", "depart")]), tmp_path / "one.csv"
    )
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "sim",
                "run",
                "--trace",
                str(path),
                "--policy",
                "round_robin",
                "--gpus",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["chunks"] == 0 and doc["stall_adjusted_attainment"] == 0.0
    assert doc["missed_periods"] == 7 and doc["unserved_chunks"] == 1


def test_sessions_starved_by_a_full_gpu_count_every_period_they_waited():
    # 15 sessions on one GPU of capacity 12: round robin places 12; the 3 others wait the full
    # 60 s and depart without a chunk: ceil((60,000 - 1,250) / 1,250) = 47 periods each.
    r = simulate(_crowd(15, 60.0), "round_robin", gpus=1)
    assert r.unserved_chunks >= 3
    assert r.missed_periods >= 3 * 47
    assert r.stall_adjusted_attainment < r.deadline_attainment


def test_a_session_that_goes_idle_after_waiting_past_the_deadline_is_counted_once():
    # No GPU: "a" waits 3 s then goes idle (1.75 s past the allowance: 2 periods), comes back
    # and goes idle after 1 s (within the allowance: its chunk might still have been on time).
    trace = make_trace(
        "idle",
        [
            (0.0, "a", "arrive"),
            (3.0, "a", "idle"),
            (5.0, "a", "active"),
            (6.0, "a", "idle"),
            (8.0, "a", "depart"),
        ],
    )
    r = simulate(trace, "round_robin", gpus=0)
    assert r.latencies_ms == [] and r.missed_periods == 2 and r.unserved_chunks == 1


class _AllOnOneGpu:
    name = "all_on_one"

    class view:  # noqa: N801 - the attribute the simulator reads
        gpus = {"g0": None}

    def step(self, event):
        if event.kind is EventKind.ARRIVE:
            return [Assign(event.session_id, "g0")]
        return []

    def note_pass(self, gpu_id, ends_at):
        pass


def test_trace_end_counts_every_session_whose_next_chunk_is_overdue():
    # 30 sessions in one batch: a chunk takes longer than the period, so the clocks keep
    # slipping and at the end of the trace many next chunks are overdue.
    assert PROFILE.chunk_ms(30) > PROFILE.deadline_ms
    seen = 0
    for tenth in range(100, 130):  # trace ends at 10.0-12.9 s, at various phases of a chunk
        trace = make_trace(
            "crowd_end",
            [(0.0, f"s{i:02d}", "arrive") for i in range(30)] + [(tenth / 10, "z", "arrive")],
        )
        sim = Simulator(trace, _AllOnOneGpu(), PROFILE)
        result = sim.run()
        end = trace.duration
        overdue = []
        for s in sim.sessions.values():
            if not s.active:
                continue
            late = (
                (end - s.spell_start) * 1000.0 - PROFILE.deadline_ms
                if s.first
                else (end - s.due) * 1000.0
            )
            if late > 1e-6:
                overdue.append(math.ceil(late / PROFILE.deadline_ms - 1e-9))
        assert result.unserved_chunks == len(overdue)
        late_chunks = sum(1 for x in result.latencies_ms) - result.on_time_chunks
        assert result.missed_periods >= late_chunks + sum(overdue)
        seen += len(overdue)
    assert seen, "the scenario must leave overdue chunks at some trace end"


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

    def note_pass(self, gpu_id, ends_at):
        pass


def test_a_releasing_gpu_counts_in_peak_and_timeline_until_its_last_pass_ends():
    trace = make_trace(
        "rel",
        [(0.0, "s1", "arrive"), (0.5, "z", "arrive"), (5.0, "s1", "depart"), (5.0, "z", "depart")],
    )
    profile = load_profile()
    # Back to back (no pacing), so that g0 is mid-pass when the TICK releases it.
    sim = Simulator(trace, _Scripted(), profile, boot_delay_s=30.0, chunk_period_s=0)
    r = sim.run()
    g0 = sim.gpus["g0"]
    assert g0.released_at is not None and g0.released_at > 1.0  # its pass ran past the TICK
    assert r.peak_gpus == 3  # g0 still running while g1 holds s1 and g2 boots
    held = [(t, n) for t, n, _ in r.timeline]
    assert (1.0, 3) in held
    assert (g0.released_at, 2) in held

"""What a viewer sees: the ledger both the simulator and a live replay count with."""

from __future__ import annotations

import pytest

from lab.sim.viewer import ServiceLedger, summary

P_S, D_MS = 1.25, 1250.0


def test_on_time_chunks_and_stalls():
    ledger = ServiceLedger(P_S, D_MS)
    assert ledger.delivered(900.0, startup_ms=900.0) == 0  # first chunk: startup within D
    assert ledger.delivered(-300.0) == 0  # 300 ms ahead of its due time
    assert ledger.delivered(0.0) == 0  # exactly on time
    assert ledger.delivered(13.0) == 1  # a 13 ms stall: one period without a new chunk
    assert ledger.delivered(60_000.0) == 48  # frozen for 60 s: 48 periods
    assert ledger.delivered(700.0, startup_ms=3000.0) == 2  # waited 3 s for a GPU first
    assert (ledger.chunks, ledger.on_time, ledger.missed_periods) == (6, 3, 51)
    assert ledger.deadline_attainment == pytest.approx(3 / 6)
    assert ledger.stall_adjusted_attainment == pytest.approx(3 / 54)
    assert ledger.missed_at_start == 2 and ledger.startups_ms == [900.0, 3000.0]
    # Latencies are the worker's lateness, never negative.
    assert ledger.latencies_ms == [900.0, 0.0, 0.0, 13.0, 60_000.0, 700.0]


def test_spells_that_end_overdue():
    ledger = ServiceLedger(P_S, D_MS)
    assert ledger.spell_ended(1000.0, first=True) == 0  # left before it was owed anything
    assert ledger.spell_ended(10_000.0, first=True) == 7  # ceil(8750 / 1250)
    assert ledger.spell_ended(-200.0, first=False) == 0  # its next chunk was not due yet
    assert ledger.spell_ended(1.0, first=False) == 1  # overdue by 1 ms: a period missed
    assert (ledger.missed_periods, ledger.overdue_spells, ledger.chunks) == (8, 2, 0)
    assert ledger.missed_at_start == 7  # the first-spell wait; the other was mid-stream
    assert ledger.stall_adjusted_attainment == 0.0
    assert ServiceLedger(P_S, D_MS).stall_adjusted_attainment == 1.0  # nothing owed


def test_without_pacing_a_chunk_is_on_time_within_the_deadline():
    """P = 0: chunks back to back, each due when the one before was done: its latency is its
    generation time, on time within D (the chunk-level model's rule), missed periods in D."""
    ledger = ServiceLedger(0.0, D_MS)
    assert ledger.delivered(1201.0) == 0
    assert ledger.delivered(1300.0) == 1
    assert ledger.delivered(3800.0) == 3  # 2550 ms past D: ceil(2550 / 1250)
    assert ledger.period_ms == D_MS


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="period_s"):
        ServiceLedger(-1.0, D_MS)
    with pytest.raises(ValueError, match="deadline_ms"):
        ServiceLedger(P_S, 0.0)
    with pytest.raises(ValueError, match="slack_ms"):
        ServiceLedger(P_S, D_MS, slack_ms=float("nan"))


def test_slack_forgives_small_stalls_only():
    ledger = ServiceLedger(P_S, D_MS, slack_ms=50.0)
    assert ledger.delivered(40.0) == 0 and ledger.delivered(60.0) == 1


def test_summary_and_its_keys():
    ledger = ServiceLedger(P_S, D_MS)
    for x in (0.0, 0.0, 100.0, 1000.0):
        ledger.delivered(x)
    doc = ledger.summary()
    assert set(doc) == {
        "latency_ms",
        "chunks",
        "chunks_on_time",
        "missed_periods",
        "missed_periods_at_start",
        "startup_ms",
        "deadline_attainment",
        "stall_adjusted_attainment",
    }
    assert doc["latency_ms"] == summary([0.0, 0.0, 100.0, 1000.0])
    assert summary([]) == {"p50": 0.0, "p99": 0.0, "max": 0.0}
    assert summary([1.0, 2.0, 3.0])["p50"] == 2.0

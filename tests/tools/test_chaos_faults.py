"""What `turboserve chaos` reports per fault, from the viewers' stall spans and the scheduler's
ticks (pure: no mesh)."""

from __future__ import annotations

import pytest

from tools.chaos import FAULT_WINDOW_S, HA_ACTIONS, HA_FAULTS, fault_figures


def test_each_fault_gets_the_stalls_that_ended_in_its_window():
    taken = [
        {"t": 10.0, "at": 1010.0, "action": "nats-leader", "detail": "x"},
        {"t": 30.0, "at": 1030.0, "action": "redis-primary", "detail": "y"},
    ]
    spans = [
        [1009.5, 1016.0, 5.25],  # waiting at the first fault, for 6 s after it
        [1012.0, 1014.0, 0.75],
        [1029.0, 1031.5, 1.25],  # began before the second fault, ended in its window
        [1090.0, 1092.0, 0.75],  # after every window
    ]
    ticks = [1005.0, 1005.25, 1009.75, 1010.0, 1010.25, 1030.0, 1034.0, 1034.25]
    first, second = fault_figures(taken, spans, ticks, period_s=1.25)
    assert (first["fault"], first["longest_stall_s"]) == ("nats-leader", 5.25)
    assert first["next_chunk_s"] == pytest.approx(6.0) and first["window_s"] == 20.0
    assert first["scheduler_pause_s"] == pytest.approx(19.75)  # 1010.25 -> 1030.0
    assert (second["fault"], second["longest_stall_s"]) == ("redis-primary", 1.25)
    assert second["next_chunk_s"] == pytest.approx(1.5)
    assert second["scheduler_pause_s"] == pytest.approx(4.0)
    assert second["window_s"] == FAULT_WINDOW_S


def test_a_fault_nobody_waited_through_has_no_next_chunk_figure():
    taken = [{"t": 5.0, "at": 500.0, "action": "sentinel", "detail": "z"}]
    (only,) = fault_figures(taken, [], [], period_s=1.25)
    assert only["longest_stall_s"] == 0.0 and only["next_chunk_s"] is None
    assert only["scheduler_pause_s"] is None


def test_the_ha_faults_are_actions_of_the_ha_run():
    assert set(HA_FAULTS) <= set(HA_ACTIONS) and "nats" not in HA_ACTIONS

"""`turboserve bench control` runs end to end (its figures are printed, not asserted)."""

from __future__ import annotations

import pytest

from tools.bench.control import format_table, measure

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_bench_control_measures_both_figures(infra):
    result = await measure(infra.nats_url, infra.redis_url, events=12, sessions=2)
    assert result["event_samples"] == 12 and result["create_samples"] == 2
    assert 0 < result["event_to_command_ms_p50"] <= result["event_to_command_ms_p99"]
    assert result["create_to_first_step_ms_p99"] > 0
    assert "| event to command |" in format_table(result)

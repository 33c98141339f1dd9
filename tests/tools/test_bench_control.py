"""`turboserve bench control` runs end to end (its figures are printed, not asserted)."""

from __future__ import annotations

import pytest

from tools.bench.control import format_table, measure

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_bench_control_measures_its_figures(infra):
    result = await measure(infra.nats_url, infra.redis_url, events=12, sessions=2, placements=12)
    assert result["event_samples"] == 12 and result["create_samples"] == 2
    assert result["placement_samples"] == 12 and result["placements_per_s"] > 0
    # every placement reads and claims its session in Redis, and the probe checks its ASSIGN
    assert result["redis_commands_per_placement"] >= 2
    assert 0 < result["event_to_command_ms_p50"] <= result["event_to_command_ms_p99"]
    assert result["create_to_first_step_ms_p99"] > 0
    assert "| event to command |" in format_table(result)
    assert "| placements per second |" in format_table(result)

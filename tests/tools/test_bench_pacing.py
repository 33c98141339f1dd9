"""`turboserve bench pacing` runs end to end: real gateway, scheduler and tiny worker, SSE clients.

Its figures are printed, not asserted; what is checked is that it measures what it says (every
session streamed in the window, no chunk done more than the pace lead before its due time, the
newcomers timed).
"""

from __future__ import annotations

import argparse

import pytest

from tools.bench.pacing import format_table, measure

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_bench_pacing_measures_every_session(infra):
    args = argparse.Namespace(
        sessions=2, preset="tiny", period=0.5, window=3.0, stagger=0.2, newcomers=1
    )
    result = await measure(infra.nats_url, infra.redis_url, args)
    assert result["period_s"] == 0.5 and result["playback_chunks_per_s"] == 2.0
    assert result["chunks_per_s_min"] > 0
    assert result["ahead_ms_max"] <= 500 + 50  # the lead is one period
    assert len(result["first_chunk_s"]) == 1 and result["first_chunk_s"][0] > 0
    assert "| chunks/s per session" in format_table(result)

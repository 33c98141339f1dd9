"""`turboserve bench v2v` runs end to end: real gateway, scheduler and stand-in worker, camera
clients over the WebSocket. Its figures are printed, not asserted; what is checked is that it
measures what it says (every count streamed in the window, delays from capture to arrival,
the encoder timed)."""

from __future__ import annotations

import argparse

import pytest

from tools.bench.v2v import format_table, measure

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_bench_v2v_measures_delay_and_the_encoder(infra):
    args = argparse.Namespace(
        window=3.0, fps=16.0, strength=0.5, preset="tiny", model=None, resolution=None
    )
    result = await measure(infra.nats_url, infra.redis_url, args, [1, 2])
    assert [row["sessions"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["chunks"] > 0 and row["chunks_per_s_min"] > 0
        # A frame's delay holds at least the rest of its input chunk's capture: positive.
        assert 0 < row["delay_ms_p50"] <= row["delay_ms_p99"]
    assert result["encode_ms_per_chunk"] is not None and result["encode_ms_per_chunk"] > 0
    assert result["resolution"] == "64x64" and result["strength"] == 0.5
    assert "delay p99 (ms)" in format_table(result)

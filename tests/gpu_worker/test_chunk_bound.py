"""The worker checks the chunk's bound against the server's real max_payload at start: a
bitrate whose chunk cannot fit one NATS message is refused then, naming both numbers, not
chunk after chunk."""

from __future__ import annotations

import pytest

from shared.settings import SettingsError
from shared.video import chunk_wire_bytes
from tests.gpu_worker.worker_harness import worker_in_process

pytestmark = pytest.mark.integration


async def test_a_bitrate_whose_chunk_cannot_fit_max_payload_is_refused_at_start(env, nats_client):
    wire = chunk_wire_bytes(8_000_000, 1.5)  # 8 Mbit/s over a 1.5 s period: 2 MB a chunk
    limit = nats_client.max_payload  # the server's own (1 MiB by default)
    assert wire > limit
    with pytest.raises(SettingsError) as refused:
        async with worker_in_process(
            env, worker_id="wbig", chunk_period_s=1.5, video_bitrate=8_000_000
        ):
            pass
    text = str(refused.value)
    assert "TURBOSERVE_VIDEO_BITRATE=8000000" in text
    assert str(wire) in text and str(limit) in text

"""The encoded stream across a live migration and a worker's crash (real worker processes, the
tiny model, the real NATS and Redis): every chunk's fragment decodes on its own, the first from
the new worker included, and the fragments' times go on along one timeline, so a player that
appends them never sees a gap or a jump."""

from __future__ import annotations

import pytest

from services.gpu_worker.fmp4 import decode_fragment
from tests.eventually import eventually
from tests.gpu_worker.test_worker_crash import by_seq, run_crash
from tests.gpu_worker.worker_harness import (
    mesh_context,
    start_session,
    worker_processes,
)
from tests.scheduler.live.test_migration_live import PERIOD, assert_consecutive, stop
from tools.ctl import Ctl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def env(infra, isolation, nats_client, redis_client):
    return {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_METRICS_PORT": "-1",
        **isolation,
    }


def check_timeline(chunks: list) -> None:
    """Each fragment alone: its frames, its size, its first frame at its start_s; and each
    starts where the one before ended."""
    for chunk in chunks:
        frames, times = decode_fragment(chunk.fmp4)
        assert frames.shape[0] == round(chunk.duration_s * chunk.fps), chunk.seq
        assert frames.shape[1:3] == (chunk.height + chunk.height % 2, chunk.width + chunk.width % 2)
        assert times[0] == pytest.approx(chunk.start_s, abs=1e-4), chunk.seq
        assert chunk.start_s == pytest.approx(chunk.seq * chunk.duration_s), chunk.seq
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after.start_s == pytest.approx(before.start_s + before.duration_s), after.seq


async def test_fragments_decode_alone_and_keep_their_timeline_across_a_migration(env):
    async with (
        mesh_context(env) as (ctx, rx),
        worker_processes(ctx, env, ["wa", "wb"], chunk_period_s=PERIOD),
    ):
        await start_session(ctx, "wa", "moved", prompt="a paper boat on a river", seed=7)
        await eventually(lambda: len(rx.chunks["moved"]) >= 4, 30, "chunks on wa")
        report = await Ctl(ctx).migrate("moved", "wb", 30)
        assert report["ok"]
        await eventually(lambda: len(rx.chunks["moved"]) >= 10, 30, "chunks on wb")
        await stop(ctx, "moved")
    assert_consecutive(rx, "moved")
    chunks = [c for _, c in rx.chunks["moved"]][:10]
    assert {c.worker_id for c in chunks} == {"wa", "wb"}
    check_timeline(chunks)


async def test_fragments_decode_alone_and_keep_their_timeline_across_a_crash(env):
    rx, _, victim, survivor = await run_crash(env, recovery=True)
    chunks = [copies[0] for _, copies in sorted(by_seq(rx, "s").items())]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert {c.worker_id for c in chunks} == {victim, survivor}
    check_timeline(chunks)

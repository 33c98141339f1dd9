"""Where `ctl drain` moves a session: never onto a worker whose slots are taken, by the
registry's count of the sessions executing there when that is more than its heartbeat says.

The situation of a drain that filled a worker to 13 of its 12 slots: the destination's record
said 8 active, as its last heartbeat did, while the moves of the drain had already put 12 there.
Real Redis; the records are written as the workers and the moves write them."""

from __future__ import annotations

import pytest

from shared.registry import Registry, WorkerRecord
from shared.wire import WorkerStatus
from tests.gpu_worker.worker_harness import mesh_context
from tools.ctl import Ctl, CtlError

pytestmark = pytest.mark.integration

SLOTS = 12


async def worker(registry: Registry, wid: str, beat_active: int, executing: int) -> None:
    """A ready worker whose heartbeat says ``beat_active`` sessions and on which the registry
    has ``executing`` sessions executing (claimed by it)."""
    sessions = tuple(f"{wid}-s{i}" for i in range(executing))
    for sid in sessions:
        record = await registry.create_session(sid, "p", 1)
        await registry.claim(sid, wid, record.epoch)
    await registry.register_worker(
        WorkerRecord(
            wid,
            WorkerStatus.READY,
            capacity=SLOTS,
            alive=True,
            active=beat_active,
            sessions=sessions[:beat_active],
        ),
        ttl_s=60.0,
    )


async def test_a_drain_moves_nothing_onto_a_worker_its_moves_have_filled(env):
    async with mesh_context(env) as (ctx, _):
        registry = ctx.registry
        ctl = Ctl(ctx)
        await worker(registry, "wa", beat_active=5, executing=5)  # the drained one
        # wb: 8 by its heartbeat, 12 by the registry (four sessions moved there since).
        await worker(registry, "wb", beat_active=8, executing=12)
        await worker(registry, "wc", beat_active=11, executing=11)
        assert await ctl._target("wa") == "wc"  # its one free slot; wb has none left

        # wc's last slot taken (by the registry; its heartbeat still says 11): no worker is
        # left with a free slot, and ctl says so rather than overfill one.
        extra = await registry.create_session("wc-extra", "p", 1)
        await registry.claim("wc-extra", "wc", extra.epoch)
        with pytest.raises(CtlError, match="no other ready worker with a free slot"):
            await ctl._target("wa")
        # An idle session takes no slot: it may still be parked on a full worker.
        assert await ctl._target("wa", active=False) in ("wb", "wc")

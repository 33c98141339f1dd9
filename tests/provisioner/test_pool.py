"""The pool's rules for START and STOP, without processes, NATS or Redis."""

from __future__ import annotations

import itertools

import pytest

from services.provisioner.pool import (
    ID_IN_USE,
    KIND_UNAVAILABLE,
    MAX_WORKERS,
    MIN_WORKERS,
    NO_GPU,
    NOT_DRAINED,
    ManagedState,
    Pool,
)
from shared.wire import WorkerStatus


def ids(prefix: str = "n"):
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


def start(pool: Pool, worker_ids=(), count: int = 1, **kw):
    return pool.start(list(worker_ids), count, now=100.0, new_id=kw.pop("new_id", ids()), **kw)


def test_start_named_workers_is_idempotent():
    pool = Pool(min_workers=0, max_workers=4)
    verdict = start(pool, ["a", "b", "a"])
    assert verdict.accepted == ["a", "b"] and not verdict.refused and not verdict.unchanged
    again = start(pool, ["b", "c"])
    assert again.accepted == ["c"] and again.unchanged == ["b"]
    assert {s.state for s in pool.workers.values()} == {ManagedState.BOOTING}
    assert pool.workers["a"].requested_at == 100.0


def test_start_by_count_makes_new_ids_up_to_max_workers():
    pool = Pool(min_workers=0, max_workers=3)
    start(pool, ["a"])
    verdict = start(pool, count=4, new_id=ids("w"))
    assert verdict.accepted == ["w0", "w1"]
    assert [(r.code, r.worker_id) for r in verdict.refused] == [
        (MAX_WORKERS, ""),
        (MAX_WORKERS, ""),
    ]
    assert pool.size == 3


def test_a_named_worker_beyond_the_limit_is_refused_by_name():
    pool = Pool(min_workers=0, max_workers=1)
    verdict = start(pool, ["a", "b"])
    assert verdict.accepted == ["a"]
    assert [(r.code, r.worker_id) for r in verdict.refused] == [(MAX_WORKERS, "b")]


def test_gpus_of_the_host_bound_the_pool():
    pool = Pool(min_workers=0, max_workers=8, capacity=2)
    assert pool.max_size == 2
    verdict = start(pool, ["a", "b", "c"])
    assert verdict.accepted == ["a", "b"] and verdict.refused[0].code == NO_GPU


def test_an_id_another_live_worker_has_is_refused():
    pool = Pool(min_workers=0, max_workers=4)
    verdict = start(pool, ["a", "x"], in_use={"x"})
    assert verdict.accepted == ["a"] and [(r.code, r.worker_id) for r in verdict.refused] == [
        (ID_IN_USE, "x")
    ]
    # our own workers are alive in the registry too: that is no clash
    assert start(pool, ["a"], in_use={"a"}).unchanged == ["a"]


def test_a_stopping_worker_cannot_be_started_again_until_gone():
    pool = Pool(min_workers=0, max_workers=4)
    start(pool, ["a"])
    assert pool.stop(["a"], {}).accepted == ["a"]
    verdict = start(pool, ["a"])
    assert verdict.refused[0].code == ID_IN_USE and not verdict.accepted
    pool.remove("a")
    assert start(pool, ["a"]).accepted == ["a"]


def test_kind_is_checked_against_the_emulated_kind():
    pool = Pool(min_workers=0, max_workers=4, emulated="H20")
    assert start(pool, ["a"], gpu_kind="h20").accepted == ["a"]
    verdict = start(pool, ["b"], gpu_kind="H100")
    assert not verdict.accepted and verdict.refused[0].code == KIND_UNAVAILABLE
    assert "H20" in verdict.refused[0].detail
    # a pool of real devices does not know their kind before they report it
    assert start(Pool(0, 4), ["c"], gpu_kind="H100").accepted == ["c"]


def test_stop_refuses_a_worker_that_holds_sessions():
    pool = Pool(min_workers=0, max_workers=4)
    start(pool, ["a", "b"])
    verdict = pool.stop(["a", "b"], {"a": ["s1", "s2"]})
    assert verdict.accepted == ["b"]
    [refusal] = verdict.refused
    assert refusal.code == NOT_DRAINED and refusal.worker_id == "a"
    assert "2 session(s)" in refusal.detail and "s1" in refusal.detail
    assert pool.workers["a"].state is ManagedState.BOOTING
    assert pool.workers["b"].state is ManagedState.STOPPING


def test_stop_never_goes_below_min_workers():
    pool = Pool(min_workers=2, max_workers=4)
    start(pool, ["a", "b", "c"])
    verdict = pool.stop(["a", "b", "c"], {})
    assert verdict.accepted == ["a"]
    assert [r.code for r in verdict.refused] == [MIN_WORKERS, MIN_WORKERS]
    assert pool.live == 2 and pool.size == 3  # "a" holds its GPU until it is gone


def test_stop_is_idempotent_for_stopping_and_unknown_workers():
    pool = Pool(min_workers=0, max_workers=4)
    start(pool, ["a"])
    assert pool.stop(["a"], {}).accepted == ["a"]
    again = pool.stop(["a", "ghost"], {})
    assert again.unchanged == ["a", "ghost"] and not again.accepted and not again.refused


def test_ready_and_draining_follow_heartbeats():
    pool = Pool(min_workers=0, max_workers=4)
    start(pool, ["a"])
    managed = pool.mark_ready("a", now=103.0)
    assert managed is not None and managed.ready_at == 103.0 and managed.ready.is_set()
    assert pool.mark_ready("a", now=104.0) is None  # only the first READY counts
    pool.mark_status("a", WorkerStatus.DRAINING)
    assert pool.workers["a"].state is ManagedState.DRAINING
    pool.mark_status("a", WorkerStatus.READY)
    assert pool.workers["a"].state is ManagedState.READY
    assert pool.counts()[ManagedState.READY] == 1


def test_deficit_counts_live_workers_only():
    pool = Pool(min_workers=2, max_workers=4)
    assert pool.deficit == 2
    start(pool, ["a", "b", "c"])
    pool.stop(["c"], {})
    assert pool.deficit == 0
    pool.remove("a")
    assert pool.deficit == 1
    assert Pool(min_workers=3, max_workers=8, capacity=1).deficit == 1  # bounded by the GPUs


@pytest.mark.parametrize("code", [MAX_WORKERS, NO_GPU])
def test_full_pool_names_the_limit_it_hit(code):
    capacity = 1 if code == NO_GPU else None
    pool = Pool(min_workers=0, max_workers=1 if code == MAX_WORKERS else 4, capacity=capacity)
    start(pool, ["a"])
    assert start(pool, ["b"]).refused[0].code == code

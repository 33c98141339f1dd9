"""The live scheduler's book of its pool (services/scheduler/ledger.py): pure, time passed in."""

from __future__ import annotations

import math

from services.scheduler.ledger import (
    RELEASE_RETRY_MAX_S,
    RELEASE_RETRY_MIN_S,
    RELEASE_RETRY_TICKS,
    PendingRelease,
    PoolLedger,
)
from shared.registry import WorkerRecord
from shared.wire import Heartbeat, WorkerStatus

TIMEOUT_S = 5.0
BOOT_TIMEOUT_S = 60.0
TICK_S = 0.5


def pool(**known: str) -> PoolLedger:
    """A pool that knows the workers ``known`` (id -> kind), joined at t = 0."""
    p = PoolLedger(TIMEOUT_S, BOOT_TIMEOUT_S, TICK_S)
    for wid, kind in known.items():
        p.join(wid, kind, 0.0)
    return p


def beat(
    wid: str,
    at: float,
    *,
    status: WorkerStatus = WorkerStatus.READY,
    kind: str = "H20",
    suspended: tuple[str, ...] = (),
) -> Heartbeat:
    return Heartbeat(
        worker_id=wid,
        status=status,
        capacity=4,
        active=0,
        at=at,
        gpu_kind=kind,
        suspended=list(suspended),
    )


def record(
    wid: str,
    *,
    alive: bool = True,
    status: WorkerStatus = WorkerStatus.READY,
    updated_at: float = 0.0,
    kind: str = "H20",
) -> WorkerRecord:
    return WorkerRecord(
        wid,
        status,
        capacity=4,
        alive=alive,
        updated_at=updated_at,
        gpu_kind=kind,
        sessions=("s1",),
        chunk_ms={1: 500.0},
    )


# -- workers ----------------------------------------------------------------------------------
def test_a_worker_joins_once_and_stops_being_awaited():
    p = pool()
    p.request(["g1"], now=0.0)
    assert p.join("g1", "H20", 3.0)
    assert not p.join("g1", "H20", 4.0), "a second join of a known worker"
    assert p.knows("g1") and "g1" not in p.booting
    assert not p.knows(None) and not p.knows("g2")


def test_a_heartbeat_is_recorded_for_any_worker_and_refreshes_a_known_one():
    p = pool(a="H20")
    assert p.hear(beat("a", at=9.0), now=10.0)
    assert not p.hear(beat("stranger", at=9.0), now=10.0)
    assert p.workers["a"].seen_at == 10.0
    assert set(p.beats) == {"a", "stranger"} and p.heard["stranger"] == 10.0
    assert "stranger" not in p.workers


def test_a_worker_is_silent_once_neither_its_beat_nor_its_joining_is_recent():
    p = pool(a="H20", b="H20")
    p.hear(beat("b", at=4.0), now=4.0)
    assert p.silent(now=TIMEOUT_S) == []
    assert p.silent(now=TIMEOUT_S + 0.1) == ["a"]  # joined at 0, never heard
    assert sorted(p.silent(now=4.0 + TIMEOUT_S + 0.1)) == ["a", "b"]


def test_the_time_a_beat_carries_counts_when_it_is_later_than_when_it_was_heard():
    p = pool(a="H20")
    p.hear(beat("a", at=20.0), now=1.0)  # the worker's clock ahead of ours
    assert p.silent(now=1.0 + TIMEOUT_S + 1.0) == []
    assert p.silent(now=20.0 + TIMEOUT_S + 0.1) == ["a"]


def test_leaving_forgets_everything_about_a_worker():
    p = pool(a="H20")
    p.hear(beat("a", at=1.0), now=1.0)
    p.our_drains.add("a")
    p.release("a")
    assert p.leave("a")
    assert not (p.workers or p.beats or p.our_drains or p.unreleased)
    assert not p.leave("a"), "nothing left to forget"
    p.request(["g1"], now=0.0)
    assert p.leave("g1"), "a GPU still booting counts as known"


def test_a_registry_record_keeps_a_worker_unheard_on_nats_and_nats_keeps_one_without_record():
    p = pool(a="H20", b="H20", c="H20")
    p.hear(beat("b", at=10.0), now=10.0)
    records = {"a": record("a"), "c": record("c", alive=False)}
    # a: alive in the registry; b: no record but heard lately (Redis lost it); c: expired.
    assert p.expired(records, now=11.0) == ["c"]
    assert sorted(p.expired(records, now=10.0 + TIMEOUT_S)) == ["b", "c"]


def test_dead_records_the_core_never_had_are_to_be_shown_lost():
    p = pool(known="H20")
    records = {
        "known": record("known", alive=False, updated_at=0.0),
        "ghost": record("ghost", alive=False, status=WorkerStatus.BOOTING, updated_at=0.0),
        "fresh": record("fresh", alive=False, updated_at=8.0),
        "shown": record("shown", alive=False, status=WorkerStatus.LOST, updated_at=0.0),
        "alive": record("alive", updated_at=0.0),
    }
    assert p.lost_records(records, now=10.0) == ["ghost"]
    p.hear(beat("ghost", at=9.0), now=9.0)  # heard on NATS lately: not lost yet
    assert p.lost_records(records, now=10.0) == []


def test_ready_records_the_core_does_not_know_join_with_their_record_as_their_beat():
    p = pool(known="H20")
    p.hear(beat("heard", at=7.0, kind="A100"), now=7.0)
    records = {
        "known": record("known"),
        "new": record("new", updated_at=6.0, kind="L4"),
        "heard": record("heard", kind="A100"),
        "booting": record("booting", status=WorkerStatus.BOOTING),
        "dead": record("dead", alive=False),
    }
    assert p.joining(records) == [("new", "L4"), ("heard", "A100")]
    stand_in = p.beats["new"]
    assert stand_in.at == 6.0 and stand_in.sessions == ["s1"] and stand_in.chunk_ms == {1: 500.0}
    assert p.beats["heard"].at == 7.0, "a beat heard is kept, not replaced by the record"


def test_beats_by_kind_are_those_of_known_workers():
    p = pool(a="H20", b="H20", c="L4")
    for wid in ("a", "c", "stranger"):
        p.hear(beat(wid, at=1.0), now=1.0)
    assert {k: [b.worker_id for b in v] for k, v in p.beats_by_kind().items()} == {
        "H20": ["a"],
        "L4": ["c"],
    }


def test_idle_sessions_are_parked_on_the_ready_gpu_with_the_fewest():
    p = pool(leaving="H20", full="H20", light="H20", quiet="H20")
    p.hear(beat("full", at=1.0, suspended=("x", "y")), now=1.0)
    p.hear(beat("light", at=1.0, suspended=("z",)), now=1.0)
    p.hear(beat("quiet", at=1.0, suspended=("w",)), now=1.0)
    assert p.parking_for("leaving", ["leaving", "full", "light", "quiet"]) == "light"  # tie: id
    assert p.parking_for("leaving", ["leaving", "full", "unknown"]) == "full"
    assert p.parking_for("leaving", ["leaving"]) is None


# -- drains -----------------------------------------------------------------------------------
def test_a_draining_worker_nobody_recorded_is_an_operators_hold():
    p = pool(a="H20", b="H20")
    p.our_drains.add("b")
    draining = {w: record(w, status=WorkerStatus.DRAINING) for w in ("a", "b")}
    assert p.drain_mode("a", draining["a"], {}) == "hold"
    assert p.drain_mode("b", draining["b"], {}) is None, "a drain this scheduler decided"
    assert p.drain_mode("a", draining["a"], {"a": "stop"}) == "stop"
    assert p.drain_mode("a", record("a"), {}) is None
    assert p.drain_mode("a", None, {"a": "hold"}) == "hold"


# -- GPUs asked for ---------------------------------------------------------------------------
def test_a_gpu_not_ready_within_the_boot_timeout_is_overdue():
    p = pool()
    p.request(["g1", "g2"], now=0.0)
    p.request(["g3"], now=30.0)
    assert p.boot_overdue(now=BOOT_TIMEOUT_S) == []
    assert p.boot_overdue(now=BOOT_TIMEOUT_S + 1.0) == ["g1", "g2"]
    assert p.refused("g2") and not p.refused("g2")
    assert p.boot_overdue(now=BOOT_TIMEOUT_S + 31.0) == ["g1", "g3"]


# -- GPUs given back --------------------------------------------------------------------------
def test_a_release_that_fails_is_retried_after_a_pause_that_doubles_up_to_a_bound():
    p = pool(a="H20")
    p.release("a")
    assert p.unreleased["a"] == PendingRelease(math.inf, 0), "the first attempt is under way"
    assert p.releases_due(now=1e9, held=(), in_flight=()) == []
    first = max(RELEASE_RETRY_MIN_S, RELEASE_RETRY_TICKS * TICK_S)
    assert p.release_failed("a", now=100.0) == first
    assert p.releases_due(now=100.0 + first - 0.01, held=(), in_flight=()) == []
    assert p.releases_due(now=100.0 + first, held=(), in_flight=()) == ["a"]
    assert p.release_failed("a", now=200.0) == 2 * first
    assert p.unreleased["a"] == PendingRelease(200.0 + 2 * first, 2)
    for _ in range(20):
        pause = p.release_failed("a", now=300.0)
    assert pause == RELEASE_RETRY_MAX_S
    p.released("a")
    assert "a" not in p.unreleased
    assert p.release_failed("a", now=400.0) is None, "no release left to retry"


def test_a_release_is_forgotten_once_its_worker_is_gone_or_the_core_holds_it_again():
    p = pool(held="H20", busy="H20")
    for gpu in ("held", "busy", "gone"):
        p.release_unwanted(gpu)
    assert p.releases_due(now=1.0, held=["held", "busy"], in_flight=["busy"]) == []
    assert set(p.unreleased) == {"busy"}, "an attempt in flight is left to finish"
    assert p.releases_due(now=1.0, held=[], in_flight=[]) == ["busy"]


def test_the_provisioner_taking_the_stop_ends_our_drain():
    p = pool(a="H20")
    p.our_drains.add("a")
    p.release("a")
    p.released("a")
    assert "a" not in p.our_drains and "a" not in p.unreleased
    assert p.knows("a"), "known until the provisioner reports it gone"


def test_a_worker_ready_after_its_release_is_released_once():
    p = pool(a="H20")
    p.release_unwanted("a")
    assert p.unreleased["a"] == PendingRelease(0.0, 0)
    p.release_failed("a", now=5.0)
    p.release_unwanted("a")  # ready again while a release is pending: no reset
    assert p.unreleased["a"].attempts == 1


# -- the quality budget ---------------------------------------------------------------------------
def steps_beat(wid: str, at: float, steps: int, *, full: int = 4, floor: int = 2) -> Heartbeat:
    return Heartbeat(
        worker_id=wid,
        status=WorkerStatus.READY,
        capacity=4,
        active=0,
        at=at,
        steps=steps,
        full_steps=full,
        min_steps=floor,
    )


def test_a_worker_at_the_budget_the_core_set_is_sent_nothing() -> None:
    p = pool(g1="H20")
    assert p.steps_to_resend(steps_beat("g1", 1.0, 4)) is None  # none set: full steps
    p.want_steps("g1", 3)
    p.steps_sent("g1", 2.0)
    assert p.steps_to_resend(steps_beat("g1", 3.0, 3)) is None


def test_a_worker_that_lost_its_budget_is_sent_it_again_once() -> None:
    p = pool(g1="H20")
    p.want_steps("g1", 2)
    p.steps_sent("g1", 2.0)
    # A beat taken before the answer does not count against it.
    assert p.steps_to_resend(steps_beat("g1", 1.5, 4)) is None
    # A later beat at full steps (the worker restarted, or the command was lost): send again,
    # and not again while that send is under way.
    assert p.steps_to_resend(steps_beat("g1", 3.0, 4)) == 2
    assert p.steps_to_resend(steps_beat("g1", 4.0, 4)) is None
    p.steps_sent("g1", 5.0)
    assert p.steps_to_resend(steps_beat("g1", 6.0, 2)) is None


def test_a_worker_left_at_reduced_steps_is_sent_its_full_count() -> None:
    # A scheduler that took over finds a worker its predecessor had lowered.
    p = pool(g1="H20")
    assert p.steps_to_resend(steps_beat("g1", 1.0, 2)) == 4


def test_the_workers_floor_bounds_what_counts_as_applied() -> None:
    p = pool(g1="H20")
    p.want_steps("g1", 1)  # below the worker's floor of 2: it runs 2, which is as asked
    p.steps_sent("g1", 1.0)
    assert p.steps_to_resend(steps_beat("g1", 2.0, 2)) is None


def test_steps_are_never_sent_to_a_worker_that_does_not_report_them_or_is_unknown() -> None:
    p = pool(g1="H20")
    assert p.steps_to_resend(steps_beat("g1", 1.0, 0, full=0, floor=0)) is None
    assert p.steps_to_resend(steps_beat("stranger", 1.0, 2)) is None
    p.want_steps("g1", 2)
    p.leave("g1")
    assert "g1" not in p.steps_wanted

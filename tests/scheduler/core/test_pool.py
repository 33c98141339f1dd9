"""The core's pool (services/scheduler/core/pool.py): the books of the workers behind the
policy's GPUs and every decision beyond the policy's, from small facts, time passed in."""

from __future__ import annotations

import math
from dataclasses import replace

from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller
from services.scheduler.core.pool import (
    RELEASE_RETRY_MAX_S,
    RELEASE_RETRY_MIN_S,
    RELEASE_RETRY_TICKS,
    CheckHandedBack,
    Claim,
    Found,
    GpuRefused,
    HandedBack,
    MoveEnded,
    MoveThenResume,
    ParkedStateMoved,
    PendingRelease,
    Pool,
    ReleaseUnknown,
    ResumeThere,
    SessionSeen,
    WorkerHeard,
    WorkerJoined,
    WorkerPhase,
    WorkerSeen,
)
from services.scheduler.core.types import (
    Decision,
    Drain,
    Event,
    EventKind,
    GpuState,
    Migrate,
    Release,
    RequestGpus,
    RestoredGpu,
    RestoredSession,
    Resume,
    SetSteps,
    Suspend,
)
from shared.profile import load_profile
from shared.wire import WorkerStatus

TIMEOUT_S = 5.0
BOOT_TIMEOUT_S = 60.0
TICK_S = 0.5
PROFILE = load_profile()
FIXED = ControllerConfig(rho_hat=0.7, delta=0.1, eta=0.0, autoscale=False, initial_gpus=0)


def pool(
    *ready: str,
    sessions: tuple[RestoredSession, ...] = (),
    booting: tuple[str, ...] = (),
    **known: str,
) -> Pool:
    """A pool whose policy holds the GPUs ``ready`` (READY, kind H20, known workers) and
    ``booting``, and whose books know the workers ``known`` too (id -> kind), all joined at
    t = 0."""
    policy = Controller(PROFILE, FIXED)
    gpus = [RestoredGpu(g, "H20", GpuState.READY) for g in ready]
    gpus += [RestoredGpu(g, "H20", GpuState.BOOTING) for g in booting]
    policy.restore(gpus, sessions, 0.0)
    p = Pool(policy, TIMEOUT_S, BOOT_TIMEOUT_S, TICK_S)
    for wid in ready:
        p.join(wid, "H20", 0.0)
    for wid, kind in known.items():
        p.join(wid, kind, 0.0)
    return p


def seen(
    wid: str,
    at: float,
    *,
    status: WorkerPhase = WorkerPhase.READY,
    kind: str = "H20",
    alive: bool = True,
    parked: int = 0,
    steps: int = 0,
    full: int = 0,
    floor: int = 0,
    pass_ends_at: float | None = None,
) -> WorkerSeen:
    return WorkerSeen(
        wid, status, at, kind, alive, parked, steps, full, floor, pass_ends_at=pass_ends_at
    )


def test_the_phases_are_the_wires_worker_statuses_by_value():
    assert {p.value for p in WorkerPhase} == {s.value for s in WorkerStatus}


# -- resume or assign -------------------------------------------------------------------------
def test_an_assign_of_a_pending_session_is_a_claim_at_its_epoch():
    p = pool("a")
    assert p.place(SessionSeen("s", "a", Found.PENDING, None, 3), False, 1.0) == Claim("s", "a", 3)


def test_a_session_gone_from_the_registry_departs():
    p = pool("a")
    for resume in (False, True):
        assert p.place(SessionSeen("s", "a", Found.GONE), resume, 1.0) == Event(
            1.0, EventKind.DEPART, session_id="s"
        )


def test_an_assign_of_a_session_parked_on_a_known_worker_resumes_it_there_or_moves_it():
    p = pool("a", "b")
    parked_on_a = SessionSeen("s", "a", Found.SUSPENDED, "a", 4)
    assert p.place(parked_on_a, False, 1.0) == ResumeThere("s", "a", 4)
    assert p.place(replace(parked_on_a, gpu_id="b"), False, 1.0) == MoveThenResume("s", "a", "b")
    assert p.place(replace(parked_on_a, gpu_id="b"), True, 1.0) == MoveThenResume("s", "a", "b")


def test_a_session_running_elsewhere_on_a_known_worker_repairs_the_view():
    p = pool("a", "b")
    found = SessionSeen("s", "b", Found.EXECUTING, "a", 2)
    assert p.place(found, False, 1.0) == Event(
        1.0, EventKind.MIGRATION_FAILED, session_id="s", gpu_id="a"
    )
    assert p.place(replace(found, gpu_id="a"), False, 1.0) is None, "already there"
    assert p.place(replace(found, gpu_id="a"), True, 1.0) is None, "already there"


def test_a_session_whose_worker_is_gone_is_requeued_then_claimed():
    p = pool("a")
    for state in (Found.EXECUTING, Found.SUSPENDED, Found.MIGRATING):
        assert p.place(SessionSeen("s", "a", state, "gone", 5), False, 1.0) == Claim(
            "s", "a", 5, requeue=True
        )


def test_a_resume_of_a_session_in_migration_fails_and_one_whose_state_is_lost_is_placed_anew():
    p = pool("a")
    assert p.place(SessionSeen("s", "a", Found.MIGRATING, "a", 1), True, 1.0) == Event(
        1.0, EventKind.PLACEMENT_FAILED, session_id="s", gpu_id="a"
    )
    assert p.place(SessionSeen("s", "a", Found.PENDING, None, 1), True, 1.0) == Claim("s", "a", 1)
    assert p.place(SessionSeen("s", "a", Found.SUSPENDED, "gone", 1), True, 1.0) == Claim(
        "s", "a", 1, requeue=True
    )


def test_a_moved_parked_state_is_resumed_unless_the_session_went_idle_again():
    p = pool("a", "b", sessions=(RestoredSession("s", True, "b"), RestoredSession("i", False)))
    assert p.decide(ParkedStateMoved(1.0, "s", "b", ok=True)) == [Resume("s", "b")]
    assert p.decide(ParkedStateMoved(1.0, "i", "b", ok=True)) == []
    failed = p.decide(ParkedStateMoved(2.0, "s", "b", ok=False))
    assert p.view.gpu_of("s") != "b", "the core learns the resume did not happen"
    assert all(not isinstance(d, Resume) or d.gpu_id != "b" for d in failed)


def test_a_session_suspended_during_its_move_is_suspended_where_it_landed():
    p = pool("a", "b", sessions=(RestoredSession("i", False), RestoredSession("s", True, "a")))
    assert p.decide(MoveEnded(1.0, "i", "b", executing=True)) == [Suspend("i", "b")]
    assert p.decide(MoveEnded(1.0, "i", "b", executing=False)) == []
    assert p.decide(MoveEnded(1.0, "i", "gone", executing=True)) == []
    assert p.decide(MoveEnded(1.0, "s", "a", executing=True)) == [], "active again"


def test_a_handed_back_session_is_checked_unless_it_moves_or_the_core_has_it_nowhere():
    p = pool("a", "b", sessions=(RestoredSession("s", True, "a"), RestoredSession("m", True, "a")))
    p.moving["m"] = 1
    assert p.decide(HandedBack(1.0, ("s", "m", "unknown"))) == [CheckHandedBack("s", "a")]


# -- the books follow the policy's decisions --------------------------------------------------
def decided(p: Pool, *decisions: Decision) -> None:
    """Step ``p`` once with its policy deciding ``decisions``, whatever its view says."""
    real = p.policy.step
    p.policy.step = lambda event: list(decisions)  # type: ignore[method-assign]
    try:
        p.decide(Event(7.0, EventKind.TICK))
    finally:
        p.policy.step = real  # type: ignore[method-assign]


def test_the_pool_books_the_policys_decisions_as_they_are_made():
    p = pool("a")
    decided(p, RequestGpus(("g1", "g2"), "H20"), Drain("a"), SetSteps("a", 2))
    assert p.booting == {"g1": 7.0, "g2": 7.0}
    assert p.our_drains == {"a"}
    assert p.steps_wanted == {"a": 2} and p.steps_sending == {"a"}


def test_a_migrate_is_in_flight_until_it_ends():
    p = pool("a", "b")
    decided(p, Migrate("s", "a", "b"), Migrate("s", "a", "b"))
    assert p.moving == {"s": 2}
    p.migration_ended("s")
    assert p.moving == {"s": 1}
    p.migration_ended("s")
    assert p.moving == {}


def test_a_release_starts_its_first_attempt_and_stays_known():
    p = pool("a")
    p.booting["a"] = 0.0
    decided(p, Release("a"))
    assert "a" not in p.booting
    assert p.unreleased["a"] == PendingRelease(math.inf, 0) and p.knows("a")


# -- releasing a GPU the core does not hold ---------------------------------------------------
def test_a_worker_that_joins_and_is_taken_is_not_released():
    p = pool("a")
    assert p.join("b", "H20", 1.0)
    assert not any(isinstance(d, ReleaseUnknown) for d in p.decide(WorkerJoined(1.0, "b", "H20")))
    assert p.view.state_of("b") is GpuState.READY


def test_a_worker_the_core_does_not_take_is_released_once():
    p = pool("a")
    p.join("late", "H20", 1.0)  # a GPU_READY the policy does not take: it gave it back
    p.policy.step = lambda event: []  # type: ignore[method-assign]
    assert p.decide(WorkerJoined(1.0, "late", "H20")) == [ReleaseUnknown("late")]
    assert p.unreleased["late"] == PendingRelease(0.0, 0)
    p.release_failed("late", now=5.0)
    p.decide(WorkerJoined(6.0, "late", "H20"))  # ready again while a release is pending
    assert p.unreleased["late"].attempts == 1, "no reset"


def test_a_refused_gpu_is_gone_once_and_only_while_awaited():
    p = pool("a", booting=("new",))
    booting = "new"
    p.booting[booting] = 0.0
    p.decide(GpuRefused(1.0, booting))
    assert booting not in p.booting and p.view.state_of(booting) is None
    assert p.decide(GpuRefused(2.0, booting)) == [], "not awaited any more"


# -- workers ----------------------------------------------------------------------------------
def test_a_worker_joins_once_and_stops_being_awaited():
    p = pool()
    p.booting["g1"] = 0.0
    assert p.join("g1", "H20", 3.0)
    assert not p.join("g1", "H20", 4.0), "a second join of a known worker"
    assert p.knows("g1") and "g1" not in p.booting
    assert not p.knows(None) and not p.knows("g2")


def test_a_heartbeat_is_recorded_for_any_worker_and_refreshes_a_known_one():
    p = pool(a="H20")
    assert p.hear(seen("a", at=9.0), now=10.0)
    assert not p.hear(seen("stranger", at=9.0), now=10.0)
    assert p.workers["a"].seen_at == 10.0
    assert set(p.seen) == {"a", "stranger"} and p.heard["stranger"] == 10.0
    assert "stranger" not in p.workers


def test_a_worker_is_silent_once_neither_its_beat_nor_its_joining_is_recent():
    p = pool(a="H20", b="H20")
    p.hear(seen("b", at=4.0), now=4.0)
    assert p.silent(now=TIMEOUT_S) == []
    assert p.silent(now=TIMEOUT_S + 0.1) == ["a"]  # joined at 0, never heard
    assert sorted(p.silent(now=4.0 + TIMEOUT_S + 0.1)) == ["a", "b"]


def test_the_time_a_beat_carries_counts_when_it_is_later_than_when_it_was_heard():
    p = pool(a="H20")
    p.hear(seen("a", at=20.0), now=1.0)  # the worker's clock ahead of ours
    assert p.silent(now=1.0 + TIMEOUT_S + 1.0) == []
    assert p.silent(now=20.0 + TIMEOUT_S + 0.1) == ["a"]


def test_leaving_forgets_everything_about_a_worker():
    p = pool(a="H20")
    p.hear(seen("a", at=1.0), now=1.0)
    p.our_drains.add("a")
    p.unreleased["a"] = PendingRelease(math.inf, 0)
    assert p.leave("a")
    assert not (p.workers or p.seen or p.our_drains or p.unreleased)
    assert not p.leave("a"), "nothing left to forget"
    p.booting["g1"] = 0.0
    assert p.leave("g1"), "a GPU still booting counts as known"


def test_a_registry_record_keeps_a_worker_unheard_on_nats_and_nats_keeps_one_without_record():
    p = pool(a="H20", b="H20", c="H20")
    p.hear(seen("b", at=10.0), now=10.0)
    records = [seen("a", 0.0), seen("c", 0.0, alive=False)]
    # a: alive in the registry; b: no record but heard lately (Redis lost it); c: expired.
    assert p.expired(records, now=11.0) == ["c"]
    assert sorted(p.expired(records, now=10.0 + TIMEOUT_S)) == ["b", "c"]


def test_dead_records_the_core_never_had_are_to_be_shown_lost():
    p = pool(known="H20")
    records = [
        seen("known", 0.0, alive=False),
        seen("ghost", 0.0, alive=False, status=WorkerPhase.BOOTING),
        seen("fresh", 8.0, alive=False),
        seen("shown", 0.0, alive=False, status=WorkerPhase.LOST),
        seen("alive", 0.0),
    ]
    assert p.lost_records(records, now=10.0) == ["ghost"]
    p.hear(seen("ghost", at=9.0), now=9.0)  # heard on NATS lately: not lost yet
    assert p.lost_records(records, now=10.0) == []


def test_ready_records_the_core_does_not_know_join_with_their_record_as_their_beat():
    p = pool(known="H20")
    p.hear(seen("heard", at=7.0, kind="A100"), now=7.0)
    records = [
        seen("known", 0.0),
        seen("new", 6.0, kind="L4"),
        seen("heard", 0.0, kind="A100"),
        seen("booting", 0.0, status=WorkerPhase.BOOTING),
        seen("dead", 0.0, alive=False),
    ]
    assert p.joining(records) == [("new", "L4"), ("heard", "A100")]
    assert p.seen["new"].at == 6.0
    assert p.seen["heard"].at == 7.0, "a beat heard is kept, not replaced by the record"


# -- parking ----------------------------------------------------------------------------------
def test_idle_sessions_are_parked_on_the_ready_gpu_with_the_fewest():
    p = pool("leaving", "full", "light", "quiet")
    p.hear(seen("full", at=1.0, parked=2), now=1.0)
    p.hear(seen("light", at=1.0, parked=1), now=1.0)
    p.hear(seen("quiet", at=1.0, parked=1), now=1.0)
    assert p.parking_for("leaving") == "light"  # tie: the smaller id


def test_parking_takes_only_known_ready_gpus():
    p = pool("leaving", "draining", "unknown")
    p.leave("unknown")  # the core still has it, the books no longer do
    p.decide(Event(1.0, EventKind.GPU_DRAIN, gpu_id="draining"))
    assert p.view.state_of("draining") is not GpuState.READY
    assert p.parking_for("leaving") is None


# -- drains -----------------------------------------------------------------------------------
def test_a_draining_worker_nobody_recorded_is_an_operators_hold():
    p = pool(a="H20", b="H20")
    p.our_drains.add("b")
    draining = {w: seen(w, 0.0, status=WorkerPhase.DRAINING) for w in ("a", "b")}
    assert p.drain_mode("a", draining["a"], {}) == "hold"
    assert p.drain_mode("b", draining["b"], {}) is None, "a drain this scheduler decided"
    assert p.drain_mode("a", draining["a"], {"a": "stop"}) == "stop"
    assert p.drain_mode("a", seen("a", 0.0), {}) is None
    assert p.drain_mode("a", None, {"a": "hold"}) == "hold"


def test_an_operators_drain_is_followed_once_and_cordon_and_stop_book_whose_it_is():
    p = pool("a", "b")
    assert p.drained_by_operator(seen("a", 1.0, status=WorkerPhase.DRAINING))
    assert p.follow_drain("a", "hold", 1.0) == Event(1.0, EventKind.GPU_CORDON, gpu_id="a")
    p.decide(Event(1.0, EventKind.GPU_CORDON, gpu_id="a"))
    assert p.follow_drain("a", "hold", 2.0) is None, "cordoned already"
    assert not p.drained_by_operator(seen("a", 2.0, status=WorkerPhase.DRAINING))
    assert p.undrained("a", seen("a", 3.0), 3.0) == Event(3.0, EventKind.GPU_UNCORDON, gpu_id="a")
    assert p.undrained("b", seen("b", 3.0), 3.0) is None
    assert p.follow_drain("b", "stop", 4.0) == Event(4.0, EventKind.GPU_DRAIN, gpu_id="b")
    assert "b" in p.our_drains


# -- GPUs asked for ---------------------------------------------------------------------------
def test_a_gpu_not_ready_within_the_boot_timeout_is_overdue():
    p = pool()
    p.booting.update(g1=0.0, g2=0.0, g3=30.0)
    assert p.boot_overdue(now=BOOT_TIMEOUT_S) == []
    assert p.boot_overdue(now=BOOT_TIMEOUT_S + 1.0) == ["g1", "g2"]
    del p.booting["g2"]
    assert p.boot_overdue(now=BOOT_TIMEOUT_S + 31.0) == ["g1", "g3"]


# -- GPUs given back --------------------------------------------------------------------------
def test_a_release_that_fails_is_retried_after_a_pause_that_doubles_up_to_a_bound():
    p = pool(a="H20")
    p.unreleased["a"] = PendingRelease(math.inf, 0)
    assert p.releases_due(now=1e9, in_flight=()) == []
    first = max(RELEASE_RETRY_MIN_S, RELEASE_RETRY_TICKS * TICK_S)
    assert p.release_failed("a", now=100.0) == first
    assert p.releases_due(now=100.0 + first - 0.01, in_flight=()) == []
    assert p.releases_due(now=100.0 + first, in_flight=()) == ["a"]
    assert p.release_failed("a", now=200.0) == 2 * first
    assert p.unreleased["a"] == PendingRelease(200.0 + 2 * first, 2)
    for _ in range(20):
        pause = p.release_failed("a", now=300.0)
    assert pause == RELEASE_RETRY_MAX_S
    p.released("a")
    assert "a" not in p.unreleased
    assert p.release_failed("a", now=400.0) is None, "no release left to retry"


def test_a_release_is_forgotten_once_its_worker_is_gone_or_the_core_holds_it_again():
    p = pool("held", "busy")
    for gpu in ("held", "busy", "gone"):
        p.unreleased[gpu] = PendingRelease(0.0, 0)
    assert p.releases_due(now=1.0, in_flight=["busy"]) == []
    assert set(p.unreleased) == {"busy"}, "an attempt in flight is left to finish"
    p.decide(Event(1.0, EventKind.GPU_GONE, gpu_id="busy"))  # the core lets it go
    assert p.releases_due(now=1.0, in_flight=[]) == ["busy"]


def test_the_provisioner_taking_the_stop_ends_our_drain():
    p = pool(a="H20")
    p.our_drains.add("a")
    p.unreleased["a"] = PendingRelease(math.inf, 0)
    p.released("a")
    assert "a" not in p.our_drains and "a" not in p.unreleased
    assert p.knows("a"), "known until the provisioner reports it gone"


# -- the quality budget -----------------------------------------------------------------------
def steps_seen(wid: str, at: float, steps: int, *, full: int = 4, floor: int = 2) -> WorkerSeen:
    return seen(wid, at, steps=steps, full=full, floor=floor)


def test_a_worker_at_the_budget_the_core_set_is_sent_nothing() -> None:
    p = pool(g1="H20")
    assert p.steps_to_resend(steps_seen("g1", 1.0, 4)) is None  # none set: full steps
    p.want_steps("g1", 3)
    p.steps_sent("g1", 2.0)
    assert p.steps_to_resend(steps_seen("g1", 3.0, 3)) is None


def test_a_worker_that_lost_its_budget_is_sent_it_again_once() -> None:
    p = pool("g1")
    p.want_steps("g1", 2)
    p.steps_sent("g1", 2.0)
    # A beat taken before the answer does not count against it.
    assert p.decide(WorkerHeard(2.0, steps_seen("g1", 1.5, 4))) == []
    # A later beat at full steps (the worker restarted, or the command was lost): send again,
    # and not again while that send is under way.
    assert p.decide(WorkerHeard(3.0, steps_seen("g1", 3.0, 4))) == [SetSteps("g1", 2)]
    assert p.decide(WorkerHeard(4.0, steps_seen("g1", 4.0, 4))) == []
    p.steps_sent("g1", 5.0)
    assert p.decide(WorkerHeard(6.0, steps_seen("g1", 6.0, 2))) == []


def test_a_worker_left_at_reduced_steps_is_sent_its_full_count() -> None:
    # A scheduler that took over finds a worker its predecessor had lowered.
    p = pool("g1")
    assert p.decide(WorkerHeard(1.0, steps_seen("g1", 1.0, 2))) == [SetSteps("g1", 4)]
    assert not p.steps_superseded("g1", 4)
    assert p.steps_superseded("g1", 3)


def test_the_workers_floor_bounds_what_counts_as_applied() -> None:
    p = pool(g1="H20")
    p.want_steps("g1", 1)  # below the worker's floor of 2: it runs 2, which is as asked
    p.steps_sent("g1", 1.0)
    assert p.steps_to_resend(steps_seen("g1", 2.0, 2)) is None


def test_steps_are_never_sent_to_a_worker_that_does_not_report_them_or_is_unknown() -> None:
    p = pool(g1="H20")
    assert p.steps_to_resend(steps_seen("g1", 1.0, 0, full=0, floor=0)) is None
    assert p.decide(WorkerHeard(1.0, steps_seen("stranger", 1.0, 2))) == []
    p.want_steps("g1", 2)
    p.leave("g1")
    assert "g1" not in p.steps_wanted


def test_a_budget_set_after_the_worker_left_does_not_follow_it_back() -> None:
    p = pool(g1="H20")
    p.leave("g1")
    # A SetSteps the core decided while it still held g1, carried out after the leave.
    p.want_steps("g1", 2)
    p.steps_sent("g1", 1.0)
    # g1 comes back (a restarted worker): the core holds it at full steps, and so do the
    # books, so its full-step heartbeats are not answered with the stale budget.
    p.join("g1", "H20", 2.0)
    assert p.steps_to_resend(steps_seen("g1", 3.0, 4)) is None
    assert "g1" not in p.steps_wanted


def test_a_heartbeat_tells_the_policy_where_the_pass_in_flight_ends():
    p = pool("a", "b")
    p.decide(WorkerHeard(1.0, seen("a", 1.0, pass_ends_at=60.0)))
    p.decide(WorkerHeard(1.0, seen("b", 1.0, pass_ends_at=3.0)))
    p.decide(Event(1.0, EventKind.ARRIVE, session_id="s"))
    assert p.view.gpu_of("s") == "b", "its first chunk comes soonest there"


# -- repairing the view -----------------------------------------------------------------------
def test_sessions_the_core_never_heard_of_are_to_arrive_in_their_order():
    p = pool(
        "a",
        sessions=(
            RestoredSession("placed", True, "a"),
            RestoredSession("waiting", True),
            RestoredSession("idle", False),
        ),
    )
    assert p.unheard(["new2", "placed", "waiting", "idle", "new1"]) == ["new2", "new1"]


def test_a_session_the_registry_has_on_another_known_worker_runs_there_unless_it_moves():
    p = pool(
        "a",
        "b",
        sessions=(
            RestoredSession("s", True, "a"),
            RestoredSession("m", True, "a"),
            RestoredSession("here", True, "a"),
            RestoredSession("lost", True, "a"),
        ),
    )
    p.moving["m"] = 1
    registry = {"s": "b", "m": "b", "here": "a", "lost": "gone"}
    assert p.misplaced(registry) == [("s", "b")]


def test_a_worker_the_policy_gives_back_as_it_joins_is_released_once():
    p = pool("a")
    p.join("b", "H20", 1.0)
    p.policy.step = lambda event: [Release("b")]  # type: ignore[method-assign]
    assert p.decide(WorkerJoined(1.0, "b", "H20")) == [Release("b")]


def test_a_session_its_worker_leaves_out_is_lost_to_it_only_after_a_worker_timeout():
    p = pool("a", "b", sessions=(RestoredSession("s", True, "a"), RestoredSession("t", True, "b")))
    placement = {"s": "a", "t": "b", "u": "gone"}
    # b's beat lists t; a's leaves s out; a worker not heard from says nothing either way.
    assert p.unlisted(placement, {"a": {"x"}, "b": {"t"}}) == [("s", "a")]
    assert p.unlisted(placement, {"b": set()}) == [("t", "b")]
    timeout = p.worker_timeout_s
    executing = SessionSeen("s", "a", Found.EXECUTING, "a", 4)
    assert p.lost_by_worker(executing, 100.0, 100.0 + timeout)
    assert not p.lost_by_worker(executing, 100.0, 100.0 + timeout - 0.1)  # just claimed
    # Moved on meanwhile: no longer executing there, or no longer that worker's.
    assert not p.lost_by_worker(replace(executing, state=Found.SUSPENDED), 0.0, 1e9)
    assert not p.lost_by_worker(replace(executing, owner="b"), 0.0, 1e9)
    assert not p.lost_by_worker(SessionSeen("s", "gone", Found.EXECUTING, "gone", 4), 0.0, 1e9)

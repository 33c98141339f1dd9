"""The handoff's state tables (``handoff/protocol.py``), walked without sockets: every path of
each role, events in and actions out, as h11 tests its ``_state.py``. The same paths over real
NATS, Redis and gloo are in ``test_handoff_protocol.py``."""

from __future__ import annotations

import pytest

from services.gpu_worker.handoff.codes import HandoffCode
from services.gpu_worker.handoff.protocol import (
    Answer,
    Closing,
    DestinationProtocol,
    DestinationState,
    Done,
    Effect,
    Failed,
    Lost,
    Outcome,
    ProtocolError,
    Report,
    Seen,
    SourceProtocol,
    SourceState,
    Step,
    Tell,
    as_code,
)
from shared.states import SessionState

E = 7  # the session's epoch in the MIGRATE command
MIGRATING, EXECUTING, SUSPENDED = (
    SessionState.MIGRATING,
    SessionState.EXECUTING,
    SessionState.SUSPENDED,
)


def source(*, suspended: bool = False) -> SourceProtocol:
    """A source that has frozen its session and claimed it (at e+1), waiting on the offer."""
    s = SourceProtocol("wa", "wb", E)
    assert s.start() == [Step.FREEZE]
    s.frozen(suspended)
    assert s.handle(Done()) == [Step.CLAIM]
    assert s.handle(Done(E + 1)) == [Step.OFFER]
    assert (s.state, s.epoch) == (SourceState.OFFERING, E + 1)
    return s


def sent(s: SourceProtocol) -> SourceProtocol:
    assert s.handle(Done()) == [Step.SEND]
    assert s.handle(Done()) == [Step.AWAIT_OUTCOME]
    return s


# -- the source -------------------------------------------------------------------------------
def test_source_happy_path_releases_records_and_reports_the_commit() -> None:
    s = sent(source())
    actions = s.handle(Outcome(committed=True, epoch=E + 2))
    assert actions == [Effect.RELEASE, Effect.RECORD, Report(True, None, "", E + 2)]
    assert s.state is SourceState.DONE


def test_a_bad_command_is_reported_before_anything_moves() -> None:
    s = SourceProtocol("wa", "wa", E)
    assert s.start("the target wa is this worker") == [
        Report(False, HandoffCode.INVALID_COMMAND, "the target wa is this worker", E)
    ]


def test_a_closing_endpoint_refuses_and_touches_nothing() -> None:
    s = SourceProtocol("wa", "wb", E)
    assert s.refuse(HandoffCode.DRAINING, "shutting down") == [
        Report(False, HandoffCode.DRAINING, "shutting down", E)
    ]


def test_a_refused_freeze_is_the_report_and_nothing_else() -> None:
    s = SourceProtocol("wa", "wb", E)
    s.start()
    assert s.handle(Failed(HandoffCode.BUSY, "already frozen")) == [
        Report(False, HandoffCode.BUSY, "already frozen", E)
    ]


def test_a_lost_claim_unfreezes_at_the_commands_epoch() -> None:
    s = SourceProtocol("wa", "wb", E)
    s.start()
    s.frozen(False)
    s.handle(Done())
    assert s.handle(Failed(HandoffCode.STALE_EPOCH, "epoch 9")) == [
        Effect.UNFREEZE,
        Report(False, HandoffCode.STALE_EPOCH, "epoch 9", E),
    ]
    assert s.epoch == E


def test_a_refused_offer_takes_the_session_back_without_a_notice() -> None:
    s = source()
    assert s.handle(Failed(HandoffCode.FULL, "no room")) == [Step.TAKE_BACK]
    assert s.back_state() is EXECUTING
    assert s.handle(Done(E + 2)) == [
        Effect.UNFREEZE,
        Report(False, HandoffCode.FULL, "no room", E + 2),
    ]
    assert s.epoch == E + 2


def test_an_offer_that_may_have_arrived_gets_the_abort_notice() -> None:
    s = source()
    lost_answer = Failed(HandoffCode.UNREACHABLE, "wb did not answer", delivered=True)
    assert s.handle(lost_answer) == [Effect.NOTIFY_ABORT, Step.TAKE_BACK]
    assert s.why == (HandoffCode.UNREACHABLE, "wb did not answer")


@pytest.mark.parametrize(
    ("fail_at", "event", "code"),
    [
        ("send", Failed(HandoffCode.TRANSFER_FAILED, "peer died"), HandoffCode.TRANSFER_FAILED),
        ("await", Failed(HandoffCode.TIMEOUT, "no outcome"), HandoffCode.TIMEOUT),
        ("await", Outcome(False, E + 1, "verification_failed", "bytes"), "verification_failed"),
        ("await", Outcome(False, E + 1, "a_code_from_the_future"), HandoffCode.ABORTED),
    ],
)
def test_after_the_accept_every_failure_notifies_then_takes_back(fail_at, event, code) -> None:
    s = source(suspended=True)
    s.handle(Done())
    if fail_at == "await":
        s.handle(Done())
    assert s.handle(event) == [Effect.NOTIFY_ABORT, Step.TAKE_BACK]
    assert s.back_state() is SUSPENDED  # a parked session goes back parked
    assert s.handle(Done(E + 2))[-1] == Report(False, HandoffCode(code), s.why[1], E + 2)


def test_a_lost_take_back_reads_the_registry_and_a_commit_there_is_a_success() -> None:
    s = sent(source())
    s.handle(Failed(HandoffCode.TIMEOUT, "no outcome"))
    assert s.handle(Lost("epoch 9")) == [Step.READ]
    assert s.handle(Seen(EXECUTING, "wb", E + 2)) == [
        Effect.RELEASE,
        Report(True, None, "committed by wb (its outcome did not reach us: no outcome)", E + 2),
    ]


@pytest.mark.parametrize(
    ("seen", "says", "epoch"),
    [
        (Seen(None), "gone", E + 1),
        (Seen(SessionState.PENDING, None, E + 3), "pending, owner None, epoch 10", E + 3),
        (Seen(EXECUTING, "wc", E + 4), "executing, owner wc, epoch 11", E + 4),
    ],
)
def test_a_lost_take_back_to_anyone_else_is_lost(seen, says, epoch) -> None:
    s = sent(source())
    s.handle(Failed(HandoffCode.TIMEOUT, "no outcome"))
    s.handle(Lost())
    assert s.handle(seen) == [
        Effect.RELEASE,
        Report(False, HandoffCode.LOST, f"timeout; the registry says {says}", epoch),
    ]


def test_an_unwritable_take_back_leaves_the_session_frozen_and_says_so() -> None:
    s = sent(source())
    s.handle(Failed(HandoffCode.TIMEOUT, "no outcome"))
    assert s.handle(Failed(HandoffCode.REGISTRY_UNAVAILABLE, "connection refused")) == [
        Report(
            False,
            HandoffCode.REGISTRY_UNAVAILABLE,
            "timeout: no outcome; abort not written: connection refused",
            E + 1,
        )
    ]


def test_committed_but_not_adopted_releases_and_reports_the_failure() -> None:
    s = sent(source())
    assert s.handle(Outcome(True, E + 2, "adopt_failed", "oom")) == [
        Effect.RELEASE,
        Report(False, HandoffCode.ADOPT_FAILED, "oom", E + 2),
    ]


def test_closing_mid_claim_asks_the_registry_whether_the_claim_landed() -> None:
    closing = "the source worker is closing"
    landed = SourceProtocol("wa", "wb", E)
    landed.start()
    landed.handle(Done())
    assert landed.handle(Closing()) == [Step.READ]
    assert landed.handle(Seen(MIGRATING, "wa", E + 1)) == [Step.TAKE_BACK]
    assert landed.epoch == E + 1
    assert landed.handle(Done(E + 2)) == [
        Effect.UNFREEZE,
        Report(False, HandoffCode.ABORTED, closing, E + 2),
    ]

    missed = SourceProtocol("wa", "wb", E)
    missed.start()
    missed.handle(Done())
    missed.handle(Closing())
    assert missed.handle(Seen(EXECUTING, "wa", E)) == [
        Effect.UNFREEZE,
        Report(False, HandoffCode.ABORTED, closing, E),
    ]


def test_closing_after_the_accept_notifies_and_takes_back() -> None:
    s = sent(source())
    assert s.handle(Closing()) == [Effect.NOTIFY_ABORT, Step.TAKE_BACK]
    assert s.why == (HandoffCode.ABORTED, "the source worker is closing")


def test_the_source_table_has_no_row_for_an_event_out_of_turn() -> None:
    s = source()
    with pytest.raises(ProtocolError, match="offering"):
        s.handle(Outcome(True, E + 2))
    with pytest.raises(ProtocolError):
        SourceProtocol("wa", "wb", E).handle(Closing())  # the freeze is cancellation-safe


def test_a_peers_unknown_code_reads_as_aborted() -> None:
    assert as_code("stale_epoch") is HandoffCode.STALE_EPOCH
    assert as_code("new_in_v9") is HandoffCode.ABORTED


# -- the destination --------------------------------------------------------------------------
def destination() -> DestinationProtocol:
    """A destination that accepted the offer (epoch e+1 from wa) and is receiving."""
    d = DestinationProtocol("s1", "wa", E + 1)
    assert d.admit(None) == [Step.READ]
    assert d.handle(Seen(MIGRATING, "wa", E + 1)) == [Effect.RESERVE, Answer(True), Step.RECEIVE]
    assert d.state is DestinationState.RECEIVING and not d.committing
    return d


def test_destination_happy_path_commits_then_adopts_then_tells() -> None:
    d = destination()
    assert d.handle(Done()) == [Step.COMMIT]
    assert d.committing and d.abort_notice() == []  # only the CAS decides now
    assert d.handle(Done(E + 2)) == [Step.ADOPT]
    assert d.handle(Done()) == [Tell(True, E + 2)]
    assert d.state is DestinationState.DONE


def test_a_local_refusal_is_the_answer() -> None:
    d = DestinationProtocol("s1", "wa", E + 1)
    assert d.admit((HandoffCode.FULL, "8 of 8 slots")) == [
        Answer(False, HandoffCode.FULL, "8 of 8 slots")
    ]


@pytest.mark.parametrize(
    ("event", "code", "detail"),
    [
        (Seen(None), HandoffCode.UNKNOWN_SESSION, "no session s1"),
        (
            Seen(EXECUTING, "wa", E),
            HandoffCode.STALE_EPOCH,
            "the registry has executing, owner wa, epoch 7; "
            "the offer needs migrating, owner wa, epoch 8",
        ),
        (Seen(MIGRATING, "wc", E + 1), HandoffCode.STALE_EPOCH, None),
        (
            Failed(HandoffCode.REGISTRY_UNAVAILABLE, "down"),
            HandoffCode.REGISTRY_UNAVAILABLE,
            "down",
        ),
    ],
)
def test_the_registry_must_say_migrating_from_the_source_at_the_offers_epoch(
    event, code, detail
) -> None:
    d = DestinationProtocol("s1", "wa", E + 1)
    d.admit(None)
    [answer] = d.handle(event)
    assert isinstance(answer, Answer) and not answer.accepted and answer.code is code
    assert detail is None or answer.detail == detail


def test_a_failed_transfer_unreserves_and_tells_the_source() -> None:
    d = destination()
    assert d.handle(Failed(HandoffCode.VERIFICATION_FAILED, "bytes differ")) == [
        Effect.UNRESERVE,
        Tell(False, E + 1, HandoffCode.VERIFICATION_FAILED, "bytes differ"),
    ]


def test_a_lost_commit_means_the_source_took_it_back() -> None:
    d = destination()
    d.handle(Done())
    assert d.handle(Lost("epoch 9")) == [
        Effect.UNRESERVE,
        Tell(False, E + 1, HandoffCode.STALE_EPOCH, "the source took it back: epoch 9"),
    ]


def test_the_abort_notice_cancels_a_receive_which_then_unreserves_and_drops_its_link() -> None:
    d = destination()
    assert d.abort_notice() == [Effect.CANCEL_RECEIVE]
    assert d.handle(Closing()) == [Effect.UNRESERVE, Effect.DROP_LINK]


def test_a_failed_adopt_after_the_commit_requeues_and_still_tells_committed() -> None:
    d = destination()
    d.handle(Done())
    d.handle(Done(E + 2))
    assert d.handle(Failed(HandoffCode.ADOPT_FAILED, "oom")) == [
        Effect.UNRESERVE,
        Effect.REQUEUE,
        Tell(True, E + 2, HandoffCode.ADOPT_FAILED, "oom"),
    ]


def test_the_destination_table_has_no_row_for_an_event_out_of_turn() -> None:
    d = destination()
    with pytest.raises(ProtocolError, match="receiving"):
        d.handle(Seen(MIGRATING, "wa", E + 1))
    with pytest.raises(ProtocolError):
        d.admit(None)

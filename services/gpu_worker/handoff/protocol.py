"""The handoff's two roles as state tables: events in, actions out, no I/O.

Each role is a small state machine (h11's ``_state.py`` and nats.py's protocol are the model):
the role's driver (``source.py``, ``destination.py``) carries out the actions it returns,
through the endpoint's narrow I/O (``io.py``), and feeds back what came of each as an event.
Every decision of the protocol, which step follows, which code a failure ends with, who owns
the session after a lost race, is made here, so ``tests/gpu_worker/test_handoff_states.py``
walks every path without NATS, Redis or a transport. No torch, no NATS, no Redis.

With ``e`` the session's epoch in the MIGRATE command (``docs/migration.md`` tells the steps):

- source: freeze -> claim (CAS executing|suspended -> migrating, expected e: e+1) -> offer ->
  send -> await the outcome -> release (committed at e+2); a failure after the claim takes the
  session back (CAS migrating -> executing|suspended, expected e+1: e+2) and unfreezes it, or,
  if that CAS loses, reads the registry to learn who has it;
- destination: admit (local checks, then the registry must say migrating, owner the source,
  epoch e+1) -> reserve and accept -> receive -> commit (CAS, expected e+1: e+2) -> adopt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.states import SessionState

from .codes import HandoffCode

LIVE = (SessionState.EXECUTING, SessionState.SUSPENDED)


def as_code(text: str) -> HandoffCode:
    """A peer's code as ours (a code this version does not know reads as ``aborted``)."""
    try:
        return HandoffCode(text)
    except ValueError:
        return HandoffCode.ABORTED


# -- events: what came of an action (both roles) ------------------------------------------------
@dataclass(frozen=True, slots=True)
class Done:
    """The step succeeded; ``epoch`` is the session's epoch it wrote, where it wrote one."""

    epoch: int = 0


@dataclass(frozen=True, slots=True)
class Failed:
    """The step failed with ``code``. ``delivered``: an offer that may have reached the
    destination anyway (its answer was lost), so it is told of the abort."""

    code: HandoffCode
    detail: str = ""
    delivered: bool = False


@dataclass(frozen=True, slots=True)
class Lost:
    """A registry compare-and-set found the session changed (another epoch, state or owner)."""

    detail: str = ""


@dataclass(frozen=True, slots=True)
class Seen:
    """The session's registry record (``state`` None: there is none)."""

    state: SessionState | None
    owner: str | None = None
    epoch: int = 0

    def describe(self) -> str:
        return (
            "gone"
            if self.state is None
            else f"{self.state}, owner {self.owner}, epoch {self.epoch}"
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """The destination's word on a transfer (``HandoffOutcome``)."""

    committed: bool
    epoch: int
    code: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Closing:
    """The worker is closing: the source gives the session back (its task was cancelled)."""


Event = Done | Failed | Lost | Seen | Outcome | Closing


# -- actions ----------------------------------------------------------------------------------
class Step(enum.Enum):
    """An action that ends in an event: the driver runs it and feeds back what came of it."""

    FREEZE = "freeze"  # source: StateHost.freeze -> Done | Failed
    CLAIM = "claim"  # source: CAS to migrating at the command's epoch -> Done(epoch) | Failed
    OFFER = "offer"  # source: the offer, as a request -> Done | Failed
    SEND = "send"  # source: the transfer -> Done | Failed
    AWAIT_OUTCOME = "await_outcome"  # source: the destination's outcome -> Outcome | Failed
    TAKE_BACK = "take_back"  # source: CAS back to live -> Done(epoch) | Lost | Failed
    READ = "read"  # both: the session's registry record -> Seen | Failed
    RECEIVE = "receive"  # destination: link, tensors, verification -> Done | Failed
    COMMIT = "commit"  # destination: CAS to live, owner us -> Done(epoch) | Lost | Failed
    ADOPT = "adopt"  # destination: StateHost.adopt -> Done | Failed


class Effect(enum.Enum):
    """An action whose result the protocol does not wait on."""

    UNFREEZE = "unfreeze"  # source: continue the session, at the machine's epoch
    RELEASE = "release"  # source: forget the session, the destination has it
    RECORD = "record"  # source: the handoff's measured cost joins the heartbeat's figures
    NOTIFY_ABORT = "notify_abort"  # source: tell the destination, drop the link
    RESERVE = "reserve"  # destination: hold room for the session
    UNRESERVE = "unreserve"  # destination: give the room back
    DROP_LINK = "drop_link"  # destination: the link's state is unknown after a cut transfer
    CANCEL_RECEIVE = "cancel_receive"  # destination: the source gave up while receiving
    REQUEUE = "requeue"  # destination: adopt failed after the commit: back to pending


@dataclass(frozen=True, slots=True)
class Report:
    """Source: the migration is over; what its report says."""

    ok: bool
    code: HandoffCode | None
    detail: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Answer:
    """Destination: the answer to the offer."""

    accepted: bool
    code: HandoffCode | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Tell:
    """Destination: the outcome it sends the source."""

    committed: bool
    epoch: int
    code: HandoffCode | None = None
    detail: str = ""


Action = Step | Effect | Report | Answer | Tell


class ProtocolError(RuntimeError):
    """An event the role's table has no row for: a bug in the driver, never a peer's doing."""


# -- the source -------------------------------------------------------------------------------
class SourceState(enum.Enum):
    NEW = "new"
    FREEZING = "freezing"
    CLAIMING = "claiming"  # the claim's CAS is in flight: it may land even if we are cut off
    OFFERING = "offering"
    SENDING = "sending"
    AWAITING = "awaiting"
    TAKING_BACK = "taking_back"
    SETTLING = "settling"  # closing mid-claim: the registry says whether it landed
    RESOLVING = "resolving"  # the take-back lost: the registry says who has the session
    DONE = "done"


class SourceProtocol:
    """One migration from the source's side. ``epoch`` is the session's epoch as this side
    last wrote it; the command's until the claim lands."""

    def __init__(self, worker_id: str, dst: str, epoch: int) -> None:
        self.worker_id = worker_id
        self.dst = dst
        self.epoch = epoch
        self.state = SourceState.NEW
        self.suspended = False  # the frozen session was parked (it goes back parked)
        self.delivered = False  # the destination may hold the offer: tell it if we give up
        self._why: tuple[HandoffCode, str] = (HandoffCode.ABORTED, "")  # the abort's cause

    def start(self, problem: str = "") -> list[Action]:
        """``problem``: what is wrong with the command (empty: nothing)."""
        self._expect(SourceState.NEW)
        if problem:
            return self._report(False, HandoffCode.INVALID_COMMAND, problem)
        self.state = SourceState.FREEZING
        return [Step.FREEZE]

    def refuse(self, code: HandoffCode, detail: str) -> list[Action]:
        """Refused before anything happened (the endpoint is closing)."""
        self._expect(SourceState.NEW)
        return self._report(False, code, detail)

    def frozen(self, suspended: bool) -> None:
        """What the freeze found (before its ``Done``): whether the session was parked."""
        self.suspended = suspended

    def handle(self, event: Event) -> list[Action]:
        s = self.state
        if isinstance(event, Closing):
            return self._closing()
        if s is SourceState.FREEZING:
            if isinstance(event, Done):
                self.state = SourceState.CLAIMING
                return [Step.CLAIM]
            if isinstance(event, Failed):
                return self._report(False, event.code, event.detail)
        elif s is SourceState.CLAIMING:
            if isinstance(event, Done):
                self.epoch = event.epoch
                self.state = SourceState.OFFERING
                return [Step.OFFER]
            if isinstance(event, Failed):
                return [Effect.UNFREEZE, *self._report(False, event.code, event.detail)]
        elif s is SourceState.OFFERING:
            if isinstance(event, Done):
                self.delivered = True
                self.state = SourceState.SENDING
                return [Step.SEND]
            if isinstance(event, Failed):
                self.delivered = event.delivered
                return self._abort(event.code, event.detail)
        elif s is SourceState.SENDING:
            if isinstance(event, Done):
                self.state = SourceState.AWAITING
                return [Step.AWAIT_OUTCOME]
            if isinstance(event, Failed):
                return self._abort(event.code, event.detail)
        elif s is SourceState.AWAITING:
            if isinstance(event, Outcome):
                if not event.committed:
                    return self._abort(as_code(event.code), event.detail)
                # Committed: the destination owns it (at e+2), even if it could not adopt.
                if event.code == HandoffCode.ADOPT_FAILED:
                    return [
                        Effect.RELEASE,
                        *self._report(False, HandoffCode.ADOPT_FAILED, event.detail, event.epoch),
                    ]
                return [
                    Effect.RELEASE,
                    Effect.RECORD,
                    *self._report(True, None, event.detail, event.epoch),
                ]
            if isinstance(event, Failed):
                return self._abort(event.code, event.detail)
        elif s is SourceState.TAKING_BACK:
            code, detail = self._why
            if isinstance(event, Done):
                self.epoch = event.epoch
                return [Effect.UNFREEZE, *self._report(False, code, detail)]
            if isinstance(event, Lost):
                self.state = SourceState.RESOLVING
                return [Step.READ]
            if isinstance(event, Failed):
                # Neither side can write: the session stays frozen here, migrating in the
                # registry at e+1 under our name; an operator or a restart settles it.
                return self._report(
                    False, event.code, f"{code}: {detail}; abort not written: {event.detail}"
                )
        elif s is SourceState.SETTLING:
            if isinstance(event, Seen):
                claimed = (
                    event.state is SessionState.MIGRATING
                    and event.owner == self.worker_id
                    and event.epoch == self.epoch + 1
                )
                if not claimed:
                    return [Effect.UNFREEZE, *self._report(False, *self._why)]
                self.epoch = event.epoch
                return self._take_back()
            if isinstance(event, Failed):
                return [Effect.UNFREEZE, *self._report(False, *self._why)]
        elif s is SourceState.RESOLVING:
            if isinstance(event, Seen):
                return [Effect.RELEASE, *self._resolve(event)]
            if isinstance(event, Failed):
                code, detail = self._why
                return [
                    Effect.RELEASE,
                    *self._report(
                        False, HandoffCode.LOST, f"{code}; the registry cannot say: {event.detail}"
                    ),
                ]
        raise ProtocolError(f"source in {s.value} got {event!r}")

    def _closing(self) -> list[Action]:
        detail = "the source worker is closing"
        s = self.state
        if s in (SourceState.NEW, SourceState.FREEZING, SourceState.DONE):
            # Freezing is cancellation-safe (StateHost's contract): nothing to give back.
            raise ProtocolError(f"source in {s.value} cannot be closed mid-handoff")
        self._why = (HandoffCode.ABORTED, detail)
        if s is SourceState.CLAIMING:  # the claim may or may not have landed
            self.state = SourceState.SETTLING
            return [Step.READ]
        return self._abort(HandoffCode.ABORTED, detail)

    def _abort(self, code: HandoffCode, detail: str) -> list[Action]:
        """Take the session back (CAS at e+1), telling the destination first if it may hold
        the offer (it discards now rather than at its deadline)."""
        self._why = (code, detail)
        return [Effect.NOTIFY_ABORT, *self._take_back()] if self.delivered else self._take_back()

    def _take_back(self) -> list[Action]:
        self.state = SourceState.TAKING_BACK
        return [Step.TAKE_BACK]

    @property
    def why(self) -> tuple[HandoffCode, str]:
        """The code and detail the abort under way ends with (the destination is told)."""
        return self._why

    def back_state(self) -> SessionState:
        """What the take-back writes: the state the session had before the handoff."""
        return SessionState.SUSPENDED if self.suspended else SessionState.EXECUTING

    def _resolve(self, seen: Seen) -> list[Action]:
        """The take-back lost: whoever changed the session, it is not ours any more."""
        code, detail = self._why
        if seen.owner == self.dst and seen.state in LIVE:
            return self._report(
                True,
                None,
                f"committed by {self.dst} (its outcome did not reach us: {detail})",
                seen.epoch,
            )
        epoch = seen.epoch if seen.state is not None else self.epoch
        return self._report(
            False, HandoffCode.LOST, f"{code}; the registry says {seen.describe()}", epoch
        )

    def _report(
        self, ok: bool, code: HandoffCode | None, detail: str, epoch: int | None = None
    ) -> list[Action]:
        self.state = SourceState.DONE
        return [Report(ok, code, detail, self.epoch if epoch is None else epoch)]

    def _expect(self, state: SourceState) -> None:
        if self.state is not state:
            raise ProtocolError(f"source in {self.state.value}, expected {state.value}")


# -- the destination --------------------------------------------------------------------------
class DestinationState(enum.Enum):
    ADMITTING = "admitting"  # local checks passed or not; then the registry
    CHECKING = "checking"  # reading the registry
    RECEIVING = "receiving"
    COMMITTING = "committing"  # past this point only the registry CAS decides
    ADOPTING = "adopting"
    DONE = "done"


class DestinationProtocol:
    """One offer from the destination's side: ``epoch`` is the offer's (e+1) until the commit
    writes e+2, ``src`` its sender."""

    def __init__(self, session_id: str, src: str, epoch: int) -> None:
        self.session_id = session_id
        self.src = src
        self.epoch = epoch
        self.state = DestinationState.ADMITTING

    def admit(self, refusal: tuple[HandoffCode, str] | None) -> list[Action]:
        """The local checks' verdict (the offer itself, the transport, the host's room)."""
        self._expect(DestinationState.ADMITTING)
        if refusal is not None:
            return self._refuse(*refusal)
        self.state = DestinationState.CHECKING
        return [Step.READ]

    def handle(self, event: Event) -> list[Action]:
        s = self.state
        if s is DestinationState.CHECKING:
            if isinstance(event, Seen):
                if event.state is None:
                    return self._refuse(
                        HandoffCode.UNKNOWN_SESSION, f"no session {self.session_id}"
                    )
                if (event.state, event.owner, event.epoch) != (
                    SessionState.MIGRATING,
                    self.src,
                    self.epoch,
                ):
                    return self._refuse(
                        HandoffCode.STALE_EPOCH,
                        f"the registry has {event.state}, owner {event.owner}, epoch "
                        f"{event.epoch}; the offer needs migrating, owner {self.src}, epoch "
                        f"{self.epoch}",
                    )
                self.state = DestinationState.RECEIVING
                return [Effect.RESERVE, Answer(True), Step.RECEIVE]
            if isinstance(event, Failed):
                return self._refuse(event.code, event.detail)
        elif s is DestinationState.RECEIVING:
            if isinstance(event, Done):
                self.state = DestinationState.COMMITTING
                return [Step.COMMIT]
            if isinstance(event, Failed):
                return self._discard(event.code, event.detail)
            if isinstance(event, Closing):  # the abort notice, or this worker closing
                self.state = DestinationState.DONE
                return [Effect.UNRESERVE, Effect.DROP_LINK]
        elif s is DestinationState.COMMITTING:
            if isinstance(event, Done):
                self.epoch = event.epoch
                self.state = DestinationState.ADOPTING
                return [Step.ADOPT]
            if isinstance(event, Lost):
                return self._discard(
                    HandoffCode.STALE_EPOCH, f"the source took it back: {event.detail}"
                )
            if isinstance(event, Failed):
                return self._discard(event.code, event.detail)
            if isinstance(event, Closing):  # this worker closing: the CAS may have landed
                self.state = DestinationState.DONE
                return [Effect.UNRESERVE, Effect.DROP_LINK]
        elif s is DestinationState.ADOPTING:
            if isinstance(event, Closing):  # adopt is the host's: it ends as it ends
                self.state = DestinationState.DONE
                return []
            self.state = DestinationState.DONE
            if isinstance(event, Done):
                return [Tell(True, self.epoch)]
            if isinstance(event, Failed):
                # The registry already names us: back to pending, so that the scheduler
                # places it again (its state is lost: it restarts from its prompt).
                return [
                    Effect.UNRESERVE,
                    Effect.REQUEUE,
                    Tell(True, self.epoch, HandoffCode.ADOPT_FAILED, event.detail),
                ]
        raise ProtocolError(f"destination in {s.value} got {event!r}")

    def abort_notice(self) -> list[Action]:
        """The source gave up: drop the transfer unless it is committing already."""
        return [Effect.CANCEL_RECEIVE] if self.state is DestinationState.RECEIVING else []

    @property
    def committing(self) -> bool:
        return self.state in (DestinationState.COMMITTING, DestinationState.ADOPTING)

    def _refuse(self, code: HandoffCode, detail: str) -> list[Action]:
        self.state = DestinationState.DONE
        return [Answer(False, code, detail)]

    def _discard(self, code: HandoffCode, detail: str) -> list[Action]:
        self.state = DestinationState.DONE
        return [Effect.UNRESERVE, Tell(False, self.epoch, code, detail)]

    def _expect(self, state: DestinationState) -> None:
        if self.state is not state:
            raise ProtocolError(f"destination in {self.state.value}, expected {state.value}")

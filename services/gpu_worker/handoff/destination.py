"""The destination's side of a handoff.

The steps and every decision are :class:`~.protocol.DestinationProtocol`'s (``protocol.py``);
this driver makes the local checks, carries out the protocol's actions through the endpoint's
narrow I/O (``io.py``) and feeds back what came of them.

1. An offer arrives (a NATS request). It is answered at once: refused with a stable code
   (``invalid_offer``, ``incompatible``, ``draining``, ``full``, ``exists``,
   ``unknown_session``, ``stale_epoch``), or accepted after ``StateHost.reserve`` with the
   transport and link both sides will use.
2. A receive task builds the link if it is new, receives the tensors and verifies them
   (shapes, dtypes, bytes, and the checksum under the offer's one-time secret: an offer
   without both, or with a secret seen before, is refused at step 1 as ``invalid_offer``).
3. Registry CAS migrating -> executing|suspended, owner: us, expected the offer's epoch
   (e+1 -> e+2). Only after it succeeds does ``StateHost.adopt`` run, and the outcome
   ``committed`` goes to the source.
4. Any failure before the CAS, a lost CAS (the source aborted first), or the source's abort
   notice: ``unreserve``, discard what arrived, and tell the source.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.states import SessionState
from shared.wire import HandoffAnswer, HandoffOffer, HandoffOutcome

from .codes import HandoffCode
from .host import FrozenSession, HandoffRefusal
from .io import HandoffIO, RegistryDown, RegistryLost
from .links import RECV
from .protocol import (
    Action,
    Answer,
    Closing,
    DestinationProtocol,
    Done,
    Effect,
    Event,
    Failed,
    Lost,
    Seen,
    Step,
    Tell,
)
from .rendezvous import parse_address
from .selection import NoTransport, Place, select_transport
from .tensors import (
    SECRET_BYTES,
    TAGS_PER_TRANSFER,
    BadSpec,
    VerificationFailed,
    check_specs,
    frozen_from,
    skeleton,
    verify,
    verify_checksum,
)
from .transports import TransferError

_LINK_ID = re.compile(r"[0-9a-f]{1,32}")
_SECRET = re.compile(rf"[0-9a-f]{{{2 * SECRET_BYTES}}}")
_CHECKSUM = re.compile(r"[0-9a-f]{64}")  # HMAC-SHA256
_SECRETS_KEPT = 4096  # the secrets of this many recent offers are refused if offered again
_MAX_TAG = (1 << 31) - TAGS_PER_TRANSFER  # a transfer's tags run from its tag up


class _Refuse(Exception):
    def __init__(self, code: HandoffCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(slots=True)
class _Incoming:
    offer: HandoffOffer
    protocol: DestinationProtocol
    transport: str = ""
    link_id: str = ""
    deadline: float = 0.0  # time.monotonic()
    skeleton: FrozenSession | None = None  # the offered session, meta tensors
    tensors: list[torch.Tensor] | None = None  # what arrived, verified
    task: asyncio.Task[None] | None = None

    @property
    def committing(self) -> bool:  # past this point only the registry CAS decides
        return self.protocol.committing


class Reception:
    def __init__(self, io: HandoffIO) -> None:
        self.io = io
        self.incoming: dict[str, _Incoming] = {}  # by transfer id, from accept to commit
        self._secrets: OrderedDict[str, None] = OrderedDict()  # offered here, most recent last

    # -- 1: the answer --------------------------------------------------------------------
    async def consider(self, offer: HandoffOffer) -> HandoffAnswer:
        incoming = _Incoming(offer, DestinationProtocol(offer.session_id, offer.src, offer.epoch))
        try:
            self._admit(incoming)
        except _Refuse as refusal:
            actions = incoming.protocol.admit((refusal.code, refusal.detail))
        else:
            actions = incoming.protocol.admit(None)
        while True:
            answer = await self._carry_out(incoming, actions)
            if answer is not None:
                return answer
            actions = incoming.protocol.handle(await self._step(incoming, Step.READ))

    def _admit(self, incoming: _Incoming) -> None:
        """The local checks: the offer itself, a transport both sides have, the host's room;
        the transport and link it will use. Raises :class:`_Refuse`."""
        io, offer = self.io, incoming.offer
        if io.closing:
            raise _Refuse(HandoffCode.DRAINING, f"{io.worker_id} is shutting down")
        self._check_offer(offer)
        rdv = offer.rendezvous
        try:
            transport = select_transport(
                Place(rdv.get("device", "cpu"), rdv.get("uuid", "")),
                io.place,
                offer.transport,
                io.preferred_transport,
            )
        except NoTransport as exc:
            raise _Refuse(HandoffCode.INCOMPATIBLE, str(exc)) from None
        if any(i.offer.session_id == offer.session_id for i in self.incoming.values()):
            raise _Refuse(HandoffCode.EXISTS, "this session is already arriving here")
        incoming_skeleton = skeleton(offer)
        refusal: HandoffRefusal | None = io.host.admission(incoming_skeleton)
        if refusal is not None:
            raise _Refuse(refusal.code, refusal.detail)
        cached = io.links.get(offer.src, RECV, transport)
        offered = rdv.get(f"link.{transport}")
        incoming.transport = transport
        incoming.link_id = (
            offered if cached is not None and cached.link_id == offered else rdv["new_link"]
        )
        incoming.skeleton = incoming_skeleton

    def _check_offer(self, offer: HandoffOffer) -> None:
        rdv = offer.rendezvous
        try:
            if offer.dst != self.io.worker_id:
                raise BadSpec(f"the offer is for {offer.dst}, this is {self.io.worker_id}")
            if offer.src == self.io.worker_id:
                raise BadSpec("an offer from this worker to itself")
            if offer.transfer_id in self.incoming:
                raise BadSpec(f"transfer {offer.transfer_id} is already arriving")
            if self.io.checksum:
                if not _SECRET.fullmatch(offer.secret):
                    raise BadSpec(f"an offer needs a secret of {SECRET_BYTES} bytes (hex)")
                if not _CHECKSUM.fullmatch(offer.checksum):
                    raise BadSpec("an offer needs the state's checksum (HMAC-SHA256, hex)")
                if offer.secret in self._secrets:
                    raise BadSpec("the offer's secret was offered before: a replay")
            check_specs(offer.tensors, offer.nbytes)
            parse_address(rdv.get("store", ""))
            if not _LINK_ID.fullmatch(rdv.get("new_link", "")):
                raise BadSpec("rendezvous new_link must be 1-32 hex digits")
            if not rdv.get("tag", "").isdigit() or int(rdv["tag"]) > _MAX_TAG:
                raise BadSpec(f"rendezvous tag must be an integer up to {_MAX_TAG}")
        except (BadSpec, ValueError) as exc:
            raise _Refuse(HandoffCode.INVALID_OFFER, str(exc)) from None
        if offer.secret:  # one-time: spent once offered, whatever the answer
            self._secrets[offer.secret] = None
            while len(self._secrets) > _SECRETS_KEPT:
                self._secrets.popitem(last=False)

    # -- the protocol's actions -----------------------------------------------------------
    async def _carry_out(self, incoming: _Incoming, actions: list[Action]) -> HandoffAnswer | None:
        """Carry out ``actions``; returns the answer to the offer when they hold one."""
        io, offer = self.io, incoming.offer
        answer = None
        for action in actions:
            if isinstance(action, Answer):
                answer = self._answer(incoming, action)
            elif isinstance(action, Tell):
                await self._tell(
                    offer,
                    committed=action.committed,
                    epoch=action.epoch,
                    code=action.code,
                    detail=action.detail,
                )
            elif action is Effect.RESERVE:
                io.host.reserve(offer.session_id)
                incoming.deadline = time.monotonic() + io.timeout_s
                self.incoming[offer.transfer_id] = incoming
            elif action is Effect.UNRESERVE:
                io.host.unreserve(offer.session_id)
            elif action is Effect.DROP_LINK:
                # The transfer may be half done: the link is in an unknown state, and the
                # source drops its side too (an aborted transfer costs both sides their link).
                link = io.links.get(offer.src, RECV, incoming.transport)
                if link is not None and link.link_id == incoming.link_id:
                    await asyncio.shield(io.links.drop(link))
            elif action is Effect.REQUEUE:
                try:
                    await io.move(
                        offer.session_id, SessionState.PENDING, incoming.protocol.epoch, None
                    )
                except (RegistryLost, RegistryDown) as exc:
                    io.log.error(
                        "adopt_failed_requeue_failed", session_id=offer.session_id, error=str(exc)
                    )
            elif action is Step.RECEIVE:
                incoming.task = io.spawn(
                    self._receive(incoming), name=f"receive-{offer.session_id}"
                )
            elif isinstance(action, Step):
                pass  # the caller runs it and feeds its event back
            else:
                raise AssertionError(f"the destination has no action {action}")
        return answer

    def _answer(self, incoming: _Incoming, action: Answer) -> HandoffAnswer:
        offer = incoming.offer
        if not action.accepted:
            self.io.log.info(
                "offer_refused",
                session_id=offer.session_id,
                src=offer.src,
                code=str(action.code),
                detail=action.detail,
            )
            return HandoffAnswer(
                transfer_id=offer.transfer_id,
                accepted=False,
                code=action.code or "",
                detail=action.detail,
            )
        return HandoffAnswer(
            transfer_id=offer.transfer_id,
            accepted=True,
            transport=incoming.transport,
            rendezvous={"link": incoming.link_id},
        )

    async def _step(self, incoming: _Incoming, step: Step) -> Event:
        io, offer = self.io, incoming.offer
        if step is Step.READ:
            try:
                record = await io.read(offer.session_id)
            except RegistryDown as exc:
                return Failed(HandoffCode.REGISTRY_UNAVAILABLE, str(exc))
            return Seen(None) if record is None else Seen(record.state, record.owner, record.epoch)
        if step is Step.RECEIVE:
            try:
                incoming.tensors = await self._fetch(incoming)
            except _Refuse as stop:
                return Failed(stop.code, stop.detail)
            return Done()
        if step is Step.COMMIT:
            target = SessionState.SUSPENDED if offer.suspended else SessionState.EXECUTING
            try:
                record = await io.move(offer.session_id, target, offer.epoch, io.worker_id)
            except RegistryLost as exc:
                return Lost(str(exc))
            except RegistryDown as exc:
                return Failed(HandoffCode.REGISTRY_UNAVAILABLE, str(exc))
            return Done(record.epoch)
        if step is Step.ADOPT:
            assert incoming.tensors is not None
            try:
                await io.host.adopt(frozen_from(offer, incoming.tensors), incoming.protocol.epoch)
            except Exception as exc:  # noqa: BLE001 - whatever the host raises, the session must not hang
                io.log.error(
                    "adopt_failed", session_id=offer.session_id, error=repr(exc), exc_info=exc
                )
                return Failed(HandoffCode.ADOPT_FAILED, repr(exc))
            io.log.info(
                "handoff_adopted",
                session_id=offer.session_id,
                src=offer.src,
                epoch=incoming.protocol.epoch,
                nbytes=offer.nbytes,
                suspended=offer.suspended,
            )
            return Done()
        raise AssertionError(f"the destination has no step {step}")

    # -- 2-4: receive, verify, commit, adopt ----------------------------------------------
    async def _receive(self, incoming: _Incoming) -> None:
        """The receive task: from the transfer to the outcome the source is told."""
        protocol, offer = incoming.protocol, incoming.offer
        step: Step | None = Step.RECEIVE
        try:
            while step is not None:
                try:
                    event = await self._step(incoming, step)
                except asyncio.CancelledError:  # the source's abort notice, or closing
                    await self._carry_out(incoming, protocol.handle(Closing()))
                    raise
                actions = protocol.handle(event)
                if step is Step.COMMIT or not protocol.committing:
                    # Arrived or discarded: no more an arrival that an abort notice can stop.
                    self.incoming.pop(offer.transfer_id, None)
                tell = next((a for a in actions if isinstance(a, Tell)), None)
                if tell is not None and not tell.committed:
                    self.io.log.info(
                        "handoff_discarded",
                        session_id=offer.session_id,
                        src=offer.src,
                        code=str(tell.code),
                        detail=tell.detail,
                    )
                await self._carry_out(incoming, actions)
                step = next((a for a in actions if isinstance(a, Step)), None)
        finally:
            self.incoming.pop(offer.transfer_id, None)

    async def _fetch(self, incoming: _Incoming) -> list[torch.Tensor]:
        io, offer, deadline = self.io, incoming.offer, incoming.deadline
        assert incoming.skeleton is not None
        transport = io.transport(incoming.transport)
        device = io.link_device(transport.name)
        into = io.host.receive_buffers(incoming.skeleton, str(device))
        link = None
        try:
            link = await io.links.open(
                offer.src,
                RECV,
                transport,
                incoming.link_id,
                offer.rendezvous["store"],
                device,
                deadline,
            )
            tensors = await io.run(
                transport.recv,
                link.handle,
                offer.tensors,
                int(offer.rendezvous["tag"]),
                device,
                deadline,
                into,
            )
        except TransferError as exc:
            if link is not None:
                await io.links.drop(link)
            raise _Refuse(HandoffCode.TRANSFER_FAILED, str(exc)) from None
        try:
            verify(tensors, offer.tensors, offer.nbytes)
            if io.checksum:  # a pass over every byte: off the loop
                await io.run(verify_checksum, tensors, offer)
        except VerificationFailed as exc:
            raise _Refuse(HandoffCode.VERIFICATION_FAILED, str(exc)) from None
        return tensors

    async def _tell(
        self,
        offer: HandoffOffer,
        *,
        committed: bool,
        epoch: int = 0,
        code: HandoffCode | None = None,
        detail: str = "",
    ) -> None:
        await self.io.tell(
            offer.src,
            HandoffOutcome(
                transfer_id=offer.transfer_id,
                session_id=offer.session_id,
                committed=committed,
                epoch=epoch or offer.epoch,
                code=str(code) if code else "",
                detail=detail,
            ),
        )

    def abort_notice(self, outcome: HandoffOutcome, sender: str) -> bool:
        """The source gave up on a transfer arriving here: drop it unless it is committing.
        Returns whether the notice was for a transfer arriving here (from its source: another
        worker's notice for it is dropped)."""
        incoming = self.incoming.get(outcome.transfer_id)
        if incoming is None:
            return False
        if sender != incoming.offer.src:
            self.io.log.warning(
                "worker_id_mismatch", session_id=outcome.session_id, claimed=incoming.offer.src
            )
            return True
        for action in incoming.protocol.abort_notice():
            if action is Effect.CANCEL_RECEIVE and incoming.task is not None:
                self.io.log.info(
                    "handoff_abort_notice", session_id=outcome.session_id, detail=outcome.detail
                )
                incoming.task.cancel()
        return True

"""The destination's side of a handoff.

1. An offer arrives (a NATS request). It is answered at once: refused with a stable code
   (``invalid_offer``, ``incompatible``, ``draining``, ``full``, ``exists``,
   ``unknown_session``, ``stale_epoch``), or accepted after ``StateHost.reserve`` with the
   transport and link both sides will use.
2. A receive task builds the link if it is new, receives the tensors and verifies them
   (shapes, dtypes, bytes; the checksum when the offer has one).
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.exceptions
import torch

from shared.registry import SessionNotFound, StaleEpoch
from shared.states import IllegalTransition, SessionState
from shared.wire import HandoffAnswer, HandoffOffer, HandoffOutcome

from .codes import HandoffCode
from .host import FrozenSession, HandoffRefusal
from .links import RECV
from .rendezvous import parse_address
from .selection import NoTransport, Place, select_transport
from .tensors import (
    TAGS_PER_TRANSFER,
    BadSpec,
    VerificationFailed,
    check_specs,
    frozen_from,
    skeleton,
    verify,
)
from .transports import TransferError

if TYPE_CHECKING:
    from .endpoint import HandoffEndpoint

_LINK_ID = re.compile(r"[0-9a-f]{1,32}")
_MAX_TAG = (1 << 31) - TAGS_PER_TRANSFER  # a transfer's tags run from its tag up
_CAS_ERRORS = (StaleEpoch, IllegalTransition, SessionNotFound)


class _Discard(Exception):
    def __init__(self, code: HandoffCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(slots=True)
class _Incoming:
    offer: HandoffOffer
    transport: str
    link_id: str
    deadline: float  # time.monotonic()
    skeleton: FrozenSession  # the offered session, meta tensors
    task: asyncio.Task[None] | None = None
    committing: bool = False  # past this point only the registry CAS decides


class Reception:
    def __init__(self, ep: HandoffEndpoint) -> None:
        self.ep = ep
        self.incoming: dict[str, _Incoming] = {}  # by transfer id

    # -- 1: the answer --------------------------------------------------------------------
    async def consider(self, offer: HandoffOffer) -> HandoffAnswer:
        try:
            transport, link_id, incoming_skeleton = await self._admit(offer)
        except _Discard as refusal:
            self.ep.log.info(
                "offer_refused",
                session_id=offer.session_id,
                src=offer.src,
                code=str(refusal.code),
                detail=refusal.detail,
            )
            return HandoffAnswer(
                transfer_id=offer.transfer_id,
                accepted=False,
                code=refusal.code,
                detail=refusal.detail,
            )
        self.ep.host.reserve(offer.session_id)
        incoming = _Incoming(
            offer, transport, link_id, time.monotonic() + self.ep.timeout_s, incoming_skeleton
        )
        self.incoming[offer.transfer_id] = incoming
        incoming.task = self.ep.spawn(self._receive(incoming), name=f"receive-{offer.session_id}")
        return HandoffAnswer(
            transfer_id=offer.transfer_id,
            accepted=True,
            transport=transport,
            rendezvous={"link": link_id},
        )

    async def _admit(self, offer: HandoffOffer) -> tuple[str, str, FrozenSession]:
        """The transport and link for ``offer`` and its skeleton, or :class:`_Discard` with the
        refusal."""
        ep = self.ep
        if ep.closing:
            raise _Discard(HandoffCode.DRAINING, f"{ep.worker_id} is shutting down")
        self._check_offer(offer)
        rdv = offer.rendezvous
        try:
            transport = select_transport(
                Place(rdv.get("device", "cpu"), rdv.get("uuid", "")),
                ep.place,
                offer.transport,
                ep.settings.handoff_transport,
            )
        except NoTransport as exc:
            raise _Discard(HandoffCode.INCOMPATIBLE, str(exc)) from None
        if any(i.offer.session_id == offer.session_id for i in self.incoming.values()):
            raise _Discard(HandoffCode.EXISTS, "this session is already arriving here")
        incoming = skeleton(offer)
        refusal: HandoffRefusal | None = ep.host.admission(incoming)
        if refusal is not None:
            raise _Discard(refusal.code, refusal.detail)
        await self._check_registry(offer)
        cached = ep.links.get(offer.src, RECV, transport)
        offered = rdv.get(f"link.{transport}")
        link_id = offered if cached is not None and cached.link_id == offered else rdv["new_link"]
        return transport, link_id, incoming

    def _check_offer(self, offer: HandoffOffer) -> None:
        rdv = offer.rendezvous
        try:
            if offer.dst != self.ep.worker_id:
                raise BadSpec(f"the offer is for {offer.dst}, this is {self.ep.worker_id}")
            if offer.src == self.ep.worker_id:
                raise BadSpec("an offer from this worker to itself")
            if offer.transfer_id in self.incoming:
                raise BadSpec(f"transfer {offer.transfer_id} is already arriving")
            check_specs(offer.tensors, offer.nbytes)
            parse_address(rdv.get("store", ""))
            if not _LINK_ID.fullmatch(rdv.get("new_link", "")):
                raise BadSpec("rendezvous new_link must be 1-32 hex digits")
            if not rdv.get("tag", "").isdigit() or int(rdv["tag"]) > _MAX_TAG:
                raise BadSpec(f"rendezvous tag must be an integer up to {_MAX_TAG}")
        except (BadSpec, ValueError) as exc:
            raise _Discard(HandoffCode.INVALID_OFFER, str(exc)) from None

    async def _check_registry(self, offer: HandoffOffer) -> None:
        try:
            record = await self.ep.registry.get_session(offer.session_id)
        except redis.exceptions.RedisError as exc:
            raise _Discard(HandoffCode.REGISTRY_UNAVAILABLE, str(exc)) from None
        if record is None:
            raise _Discard(HandoffCode.UNKNOWN_SESSION, f"no session {offer.session_id}")
        expected = (SessionState.MIGRATING, offer.src, offer.epoch)
        if (record.state, record.owner, record.epoch) != expected:
            raise _Discard(
                HandoffCode.STALE_EPOCH,
                f"the registry has {record.state}, owner {record.owner}, epoch {record.epoch}; "
                f"the offer needs migrating, owner {offer.src}, epoch {offer.epoch}",
            )

    # -- 2-4: receive, verify, commit, adopt ----------------------------------------------
    async def _receive(self, incoming: _Incoming) -> None:
        ep, offer = self.ep, incoming.offer
        try:
            tensors = await self._fetch(incoming)
            incoming.committing = True
            target = SessionState.SUSPENDED if offer.suspended else SessionState.EXECUTING
            try:
                record = await ep.registry.transition(
                    offer.session_id, target, expected_epoch=offer.epoch, owner=ep.worker_id
                )
            except _CAS_ERRORS as exc:
                raise _Discard(HandoffCode.STALE_EPOCH, f"the source took it back: {exc}") from None
            except redis.exceptions.RedisError as exc:
                raise _Discard(HandoffCode.REGISTRY_UNAVAILABLE, str(exc)) from None
        except _Discard as stop:
            ep.host.unreserve(offer.session_id)
            ep.log.info(
                "handoff_discarded",
                session_id=offer.session_id,
                src=offer.src,
                code=str(stop.code),
                detail=stop.detail,
            )
            await self._tell(offer, committed=False, code=stop.code, detail=stop.detail)
            return
        except asyncio.CancelledError:  # the source's abort notice, or this worker closing
            ep.host.unreserve(offer.session_id)
            # The transfer may be half done: the link is in an unknown state, and the source
            # drops its side too (an aborted transfer costs both sides their link).
            link = ep.links.get(offer.src, RECV, incoming.transport)
            if link is not None and link.link_id == incoming.link_id:
                await asyncio.shield(ep.links.drop(link))
            raise
        finally:
            self.incoming.pop(offer.transfer_id, None)
        await self._adopt(offer, tensors, record.epoch)

    async def _fetch(self, incoming: _Incoming) -> list[torch.Tensor]:
        ep, offer, deadline = self.ep, incoming.offer, incoming.deadline
        transport = ep.transport(incoming.transport)
        device = ep.link_device(transport.name)
        into = ep.host.receive_buffers(incoming.skeleton, str(device))
        link = None
        try:
            link = await ep.links.open(
                offer.src,
                RECV,
                transport,
                incoming.link_id,
                offer.rendezvous["store"],
                device,
                deadline,
            )
            tensors = await ep.run(
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
                await ep.links.drop(link)
            raise _Discard(HandoffCode.TRANSFER_FAILED, str(exc)) from None
        try:
            if offer.checksum:  # a pass over every byte: off the loop
                await ep.run(verify, tensors, offer.tensors, offer.nbytes, offer.checksum)
            else:
                verify(tensors, offer.tensors, offer.nbytes)
        except VerificationFailed as exc:
            raise _Discard(HandoffCode.VERIFICATION_FAILED, str(exc)) from None
        return tensors

    async def _adopt(self, offer: HandoffOffer, tensors: list[torch.Tensor], epoch: int) -> None:
        ep = self.ep
        try:
            await ep.host.adopt(frozen_from(offer, tensors), epoch)
        except Exception as exc:  # noqa: BLE001 - whatever the host raises, the session must not hang
            # The registry already names us: put the session back to pending so that the
            # scheduler places it again (its state is lost: it restarts from its prompt).
            ep.log.error("adopt_failed", session_id=offer.session_id, error=repr(exc), exc_info=exc)
            ep.host.unreserve(offer.session_id)
            try:
                await ep.registry.transition(
                    offer.session_id, SessionState.PENDING, expected_epoch=epoch, owner=None
                )
            except (*_CAS_ERRORS, redis.exceptions.RedisError) as cas_exc:
                ep.log.error(
                    "adopt_failed_requeue_failed", session_id=offer.session_id, error=str(cas_exc)
                )
            await self._tell(
                offer, committed=True, epoch=epoch, code=HandoffCode.ADOPT_FAILED, detail=repr(exc)
            )
            return
        ep.log.info(
            "handoff_adopted",
            session_id=offer.session_id,
            src=offer.src,
            epoch=epoch,
            nbytes=offer.nbytes,
            suspended=offer.suspended,
        )
        await self._tell(offer, committed=True, epoch=epoch)

    async def _tell(
        self,
        offer: HandoffOffer,
        *,
        committed: bool,
        epoch: int = 0,
        code: HandoffCode | None = None,
        detail: str = "",
    ) -> None:
        await self.ep.publish(
            self.ep.subjects.worker_handoff(offer.src),
            HandoffOutcome(
                transfer_id=offer.transfer_id,
                session_id=offer.session_id,
                committed=committed,
                epoch=epoch or offer.epoch,
                code=str(code) if code else "",
                detail=detail,
            ),
        )

    def abort_notice(self, outcome: HandoffOutcome) -> bool:
        """The source gave up on a transfer arriving here: drop it unless it is committing.
        Returns whether the notice was for a transfer arriving here."""
        incoming = self.incoming.get(outcome.transfer_id)
        if incoming is None:
            return False
        if not incoming.committing and incoming.task is not None:
            self.ep.log.info(
                "handoff_abort_notice", session_id=outcome.session_id, detail=outcome.detail
            )
            incoming.task.cancel()
        return True

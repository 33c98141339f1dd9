"""The source's side of a handoff: one :class:`Migration` per MIGRATE command.

With ``e`` the session's epoch in the command:

1. freeze the session at its next chunk boundary (``StateHost.freeze``);
2. registry CAS executing|suspended -> migrating, expected ``e`` (epoch e+1, owner: us);
3. offer the state to the destination (a NATS request) and, once accepted, send it;
4. wait for the destination's outcome: committed (ownership moved at e+2) -> ``release``;
5. anything else before the commit -> abort: CAS migrating -> executing|suspended, expected
   e+1 (epoch e+2, owner: us), ``unfreeze``. If that CAS loses, the destination's commit won
   (both expect e+1, exactly one succeeds): the registry says so, and we release.

The report goes to ``<prefix>.migrations`` and the registry's cluster events either way.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING

import nats.errors
import redis.exceptions

from shared.registry import SessionNotFound, StaleEpoch
from shared.states import IllegalTransition, SessionState
from shared.wire import (
    HandoffAnswer,
    HandoffOffer,
    HandoffOutcome,
    MigrationReport,
    WorkerCmdKind,
    WorkerCommand,
    decode,
    encode,
)

from .codes import HandoffCode
from .host import FrozenSession, HostRefused
from .links import SEND
from .rendezvous import new_link_id
from .selection import Place
from .stats import HandoffSample
from .tensors import checksum, spec_of, tensors_of
from .transports import TransferError

if TYPE_CHECKING:
    from .endpoint import HandoffEndpoint

_CAS_ERRORS = (StaleEpoch, IllegalTransition, SessionNotFound)
_ABORT_RETRY_S = 0.2


class _Abort(Exception):
    def __init__(self, code: HandoffCode, detail: str = "") -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def state_place(device: str, worker: Place) -> Place:
    """Where a frozen state is, as its offer says: ``device`` of its tensors (a CUDA
    worker's executing session is frozen on the device, a suspended one in host memory) and,
    on the device, the worker's GPU UUID, from which the destination picks the transport."""
    if device.startswith("cuda"):
        return Place(device=device, uuid=worker.uuid)
    return Place(device=device)


def as_code(text: str) -> HandoffCode:
    """A peer's code as ours (a code this version does not know reads as ``aborted``)."""
    try:
        return HandoffCode(text)
    except ValueError:
        return HandoffCode.ABORTED


class Migration:
    def __init__(self, ep: HandoffEndpoint, cmd: WorkerCommand) -> None:
        self.ep = ep
        self.cmd = cmd
        self.sid = cmd.session_id or ""
        self.dst = cmd.target or ""
        self.started = time.perf_counter()
        self.deadline = time.monotonic() + ep.timeout_s
        self.transfer_id = uuid.uuid4().hex
        self.epoch = cmd.epoch  # the session's epoch as we last wrote it
        self.frozen: FrozenSession | None = None
        self.accepted = False  # the destination took the offer: tell it if we give up
        self.transport = ""
        self.nbytes = 0
        self._t_offer = 0.0
        self.ms = {"freeze": 0.0, "offer": 0.0, "connect": 0.0, "transfer": 0.0, "commit": 0.0}

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def refuse(self, code: HandoffCode, detail: str) -> MigrationReport:
        return await self._done(False, code, detail)

    async def run(self) -> MigrationReport:
        problem = self._check_command()
        if problem:
            return await self._done(False, HandoffCode.INVALID_COMMAND, problem)
        try:
            self.frozen = await self._freeze()  # cancellation-safe by the StateHost contract
        except _Abort as stop:
            return await self._done(False, stop.code, stop.detail)
        try:
            return await self._migrate()
        except asyncio.CancelledError:
            await asyncio.shield(self._settle())
            raise

    async def _migrate(self) -> MigrationReport:
        try:
            await self._to_migrating()
        except _Abort as stop:
            await self.ep.host.unfreeze(self.sid, self.epoch)
            return await self._done(False, stop.code, stop.detail)
        assert self.frozen is not None
        try:
            outcome = await self._hand_over(self.frozen)
        except _Abort as stop:
            return await self._abort(stop.code, stop.detail)
        if not outcome.committed:
            return await self._abort(as_code(outcome.code), outcome.detail)
        return await self._committed(outcome.epoch, outcome.code, outcome.detail)

    async def _settle(self) -> None:
        """Cancelled (the worker is closing) after the freeze: give the session back."""
        detail = "the source worker is closing"
        if self.epoch == self.cmd.epoch:  # our CAS to migrating may or may not have landed
            record = await self.ep.registry.get_session(self.sid)
            if not (
                record
                and record.state is SessionState.MIGRATING
                and record.owner == self.ep.worker_id
                and record.epoch == self.epoch + 1
            ):
                await self.ep.host.unfreeze(self.sid, self.epoch)
                await self._done(False, HandoffCode.ABORTED, detail)
                return
            self.epoch = record.epoch
        await self._abort(HandoffCode.ABORTED, detail)

    def _check_command(self) -> str:
        cmd = self.cmd
        if cmd.kind is not WorkerCmdKind.MIGRATE:
            return f"a {cmd.kind} command is not a migration"
        if not self.sid or not self.dst:
            return "a migration needs session_id and target"
        if self.dst == self.ep.worker_id:
            return f"the target {self.dst} is this worker"
        return ""

    # -- 1-2: freeze, then the registry says migrating ------------------------------------
    async def _freeze(self) -> FrozenSession:
        on_device = self.ep.place.on_cuda and self.ep.settings.handoff_transport != "gloo"
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.left()):
                frozen = await self.ep.host.freeze(self.sid, self.epoch, on_device=on_device)
        except HostRefused as exc:
            raise _Abort(exc.code, exc.detail) from None
        except TimeoutError:
            raise _Abort(
                HandoffCode.TIMEOUT, "the session did not reach a chunk boundary"
            ) from None
        except Exception as exc:  # noqa: BLE001 - a failed freeze is reported, not raised
            self.ep.log.error("freeze_failed", session_id=self.sid, error=repr(exc), exc_info=exc)
            raise _Abort(HandoffCode.HOST_ERROR, f"freeze: {exc!r}") from None
        self.ms["freeze"] = (time.perf_counter() - t0) * 1000.0
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors_of(frozen.snapshot))
        return frozen

    async def _to_migrating(self) -> None:
        self._t_offer = time.perf_counter()
        try:
            record = await self.ep.registry.transition(
                self.sid,
                SessionState.MIGRATING,
                expected_epoch=self.epoch,
                owner=self.ep.worker_id,
            )
        except _CAS_ERRORS as exc:
            raise _Abort(HandoffCode.STALE_EPOCH, str(exc)) from None
        except redis.exceptions.RedisError as exc:
            raise _Abort(HandoffCode.REGISTRY_UNAVAILABLE, str(exc)) from None
        self.epoch = record.epoch

    # -- 3-4: offer, transfer, outcome ----------------------------------------------------
    async def _hand_over(self, frozen: FrozenSession) -> HandoffOutcome:
        ep = self.ep
        future: asyncio.Future[HandoffOutcome] = asyncio.get_running_loop().create_future()
        ep.outcomes[self.transfer_id] = future
        try:
            async with ep.send_lock(self.dst):
                offer = await self._offer(frozen)
                answer = await self._ask(offer)
                self.ms["offer"] = (time.perf_counter() - self._t_offer) * 1000.0
                await self._send(frozen, offer, answer)
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(self.left()):
                    outcome = await future
            except TimeoutError:
                raise _Abort(HandoffCode.TIMEOUT, "no outcome from the destination") from None
            self.ms["commit"] = (time.perf_counter() - t0) * 1000.0
            return outcome
        finally:
            ep.outcomes.pop(self.transfer_id, None)

    async def _offer(self, frozen: FrozenSession) -> HandoffOffer:
        ep, snap = self.ep, frozen.snapshot
        tensors = tensors_of(snap)
        held = state_place(str(tensors[0].device) if tensors else "cpu", ep.place)
        rendezvous = {
            "store": ep.address,
            "device": held.device,
            "uuid": held.uuid,
            "new_link": new_link_id(),
            "tag": str(ep.next_tag()),
        }
        for transport, link_id in ep.links.ids(self.dst, SEND).items():
            rendezvous[f"link.{transport}"] = link_id
        return HandoffOffer(
            transfer_id=self.transfer_id,
            session_id=self.sid,
            epoch=self.epoch,
            src=ep.worker_id,
            dst=self.dst,
            transport=ep.settings.handoff_transport,
            rendezvous=rendezvous,
            tensors=[spec_of(t) for t in tensors],
            nbytes=self.nbytes,
            checksum=await ep.run(checksum, tensors) if ep.checksum else "",
            suspended=frozen.suspended,
            next_seq=frozen.next_seq,
            engine_seq=snap.seq,
            position=snap.position,
            prompt=snap.prompt,
            pending_prompt=snap.pending_prompt,
            seed=snap.seed,
            preset=snap.preset,
            dtype=snap.dtype,
            meta=dict(snap.meta),
            due_at=frozen.due_at,
            command_id=self.cmd.command_id,
        )

    async def _ask(self, offer: HandoffOffer) -> HandoffAnswer:
        subject = self.ep.subjects.worker_handoff(self.dst)
        try:
            reply = await self.ep.nc.request(
                subject, encode(offer), timeout=max(self.left(), 0.001)
            )
        except nats.errors.NoRespondersError:
            raise _Abort(HandoffCode.UNREACHABLE, f"no worker {self.dst} listens") from None
        except (nats.errors.TimeoutError, TimeoutError):
            self.accepted = True  # it may have accepted: send it the abort notice
            raise _Abort(HandoffCode.UNREACHABLE, f"{self.dst} did not answer the offer") from None
        try:
            answer = decode(reply.subject or subject, reply.data, HandoffAnswer)
        except ValueError as exc:
            self.accepted = True
            raise _Abort(HandoffCode.UNREACHABLE, f"bad answer: {exc}") from None
        if not answer.accepted:
            raise _Abort(as_code(answer.code), answer.detail or f"{self.dst} refused")
        self.accepted = True
        return answer

    async def _send(
        self, frozen: FrozenSession, offer: HandoffOffer, answer: HandoffAnswer
    ) -> None:
        ep = self.ep
        try:
            transport = ep.transport(answer.transport)
        except ValueError:
            raise _Abort(
                HandoffCode.TRANSFER_FAILED, f"unknown transport {answer.transport!r}"
            ) from None
        self.transport = transport.name
        link_id = answer.rendezvous.get("link", "")
        cached = ep.links.get(self.dst, SEND, transport.name)
        if link_id != offer.rendezvous["new_link"] and (
            cached is None
            or link_id != offer.rendezvous.get(f"link.{transport.name}")
            or cached.link_id != link_id
        ):
            # Not the new link, nor the cached one we offered (it may have been torn down
            # since): building it would wait for a destination that reuses its own.
            raise _Abort(
                HandoffCode.TRANSFER_FAILED,
                f"the answer names link {link_id!r}, which this worker does not hold",
            )
        link = None
        try:
            link = await ep.links.open(
                self.dst,
                SEND,
                transport,
                link_id,
                ep.address,
                ep.link_device(transport.name),
                self.deadline,
            )
            if link is not cached:
                self.ms["connect"] = link.connect_ms
            t0 = time.perf_counter()
            await ep.run(
                transport.send,
                link.handle,
                tensors_of(frozen.snapshot),
                int(offer.rendezvous["tag"]),
                self.deadline,
            )
            self.ms["transfer"] = (time.perf_counter() - t0) * 1000.0
        except TransferError as exc:
            if link is not None:
                await ep.links.drop(link)
            raise _Abort(HandoffCode.TRANSFER_FAILED, str(exc)) from None

    # -- 5: the end -----------------------------------------------------------------------
    async def _committed(self, epoch: int, code: str, detail: str) -> MigrationReport:
        await self.ep.host.release(self.sid)
        if code == HandoffCode.ADOPT_FAILED:
            return await self._done(False, HandoffCode.ADOPT_FAILED, detail, epoch=epoch)
        self.ep.record(
            HandoffSample(
                nbytes=self.nbytes,
                offer_ms=self.ms["offer"],
                transfer_ms=self.ms["transfer"],
                commit_ms=self.ms["commit"],
                connect_ms=self.ms["connect"],
            )
        )
        return await self._done(True, None, detail, epoch=epoch)

    async def _abort(self, code: HandoffCode, detail: str) -> MigrationReport:
        """Take the session back (CAS at e+1), or learn that the destination has it."""
        ep = self.ep
        if self.accepted:
            # Let the destination discard now rather than at its deadline; the transfer may
            # have stopped half-way, so both sides drop their link (rebuilt on next use).
            await ep.publish(
                ep.subjects.worker_handoff(self.dst),
                HandoffOutcome(
                    transfer_id=self.transfer_id,
                    session_id=self.sid,
                    committed=False,
                    epoch=self.epoch,
                    code=HandoffCode.ABORTED,
                    detail=f"{code}: {detail}",
                ),
            )
            link = ep.links.get(self.dst, SEND, self.transport) if self.transport else None
            if link is not None:
                await ep.links.drop(link)
        assert self.frozen is not None
        back = SessionState.SUSPENDED if self.frozen.suspended else SessionState.EXECUTING
        retry_until = time.monotonic() + ep.timeout_s
        while True:
            try:
                record = await ep.registry.transition(
                    self.sid, back, expected_epoch=self.epoch, owner=ep.worker_id
                )
                break
            except _CAS_ERRORS:
                return await self._resolve(code, detail)
            except redis.exceptions.RedisError as exc:
                if time.monotonic() > retry_until:
                    # Neither side can write: the session stays frozen here, migrating in the
                    # registry at e+1 under our name; an operator or a restart settles it.
                    ep.log.error("abort_not_written", session_id=self.sid, error=str(exc))
                    return await self._done(
                        False,
                        HandoffCode.REGISTRY_UNAVAILABLE,
                        f"{code}: {detail}; abort not written: {exc}",
                    )
                await asyncio.sleep(_ABORT_RETRY_S)
        await ep.host.unfreeze(self.sid, record.epoch)
        return await self._done(False, code, detail, epoch=record.epoch)

    async def _resolve(self, code: HandoffCode, detail: str) -> MigrationReport:
        """Our abort CAS lost: whoever changed the session, it is not ours any more."""
        record = await self.ep.registry.get_session(self.sid)
        await self.ep.host.release(self.sid)
        if (
            record is not None
            and record.owner == self.dst
            and record.state in (SessionState.EXECUTING, SessionState.SUSPENDED)
        ):
            return await self._done(
                True,
                None,
                f"committed by {self.dst} (its outcome did not reach us: {detail})",
                epoch=record.epoch,
            )
        seen = (
            "gone"
            if record is None
            else f"{record.state}, owner {record.owner}, epoch {record.epoch}"
        )
        return await self._done(
            False,
            HandoffCode.LOST,
            f"{code}; the registry says {seen}",
            epoch=record.epoch if record else self.epoch,
        )

    async def _done(
        self, ok: bool, code: HandoffCode | None, detail: str, epoch: int | None = None
    ) -> MigrationReport:
        ep = self.ep
        report = MigrationReport(
            session_id=self.sid or "-",
            src=ep.worker_id,
            dst=self.dst or "-",
            ok=ok,
            command_id=self.cmd.command_id,
            code=str(code) if code else "",
            detail=detail,
            epoch=self.epoch if epoch is None else epoch,
            nbytes=self.nbytes,
            suspended=bool(self.frozen and self.frozen.suspended),
            transport=self.transport,
            freeze_ms=self.ms["freeze"],
            offer_ms=self.ms["offer"],
            transfer_ms=self.ms["transfer"],
            commit_ms=self.ms["commit"],
            connect_ms=self.ms["connect"],
            total_ms=(time.perf_counter() - self.started) * 1000.0,
        )
        ep.log.info(
            "migration",
            session_id=report.session_id,
            dst=report.dst,
            ok=ok,
            code=report.code,
            detail=detail,
            epoch=report.epoch,
            nbytes=self.nbytes,
            transport=self.transport,
            total_ms=round(report.total_ms, 2),
        )
        await ep.publish(ep.subjects.migrations, report)
        try:
            await ep.registry.record_cluster_event(
                "migration",
                session_id=report.session_id,
                src=report.src,
                dst=report.dst,
                ok=ok,
                code=report.code,
                nbytes=self.nbytes,
                total_ms=round(report.total_ms, 2),
                command_id=report.command_id,
            )
            await ep.registry.bump_counters(**{"migrations" if ok else "migrations_failed": 1})
        except redis.exceptions.RedisError as exc:
            ep.log.warning("cluster_event_failed", error=str(exc))
        return report

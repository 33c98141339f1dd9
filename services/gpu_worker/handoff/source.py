"""The source's side of a handoff: one :class:`Migration` per MIGRATE command.

The steps and every decision are :class:`~.protocol.SourceProtocol`'s (``protocol.py``); this
driver carries out its actions through the endpoint's narrow I/O (``io.py``), measures each
step and feeds back what came of it. With ``e`` the session's epoch in the command:

1. freeze the session at its next chunk boundary (``StateHost.freeze``);
2. registry CAS executing|suspended -> migrating, expected ``e`` (epoch e+1, owner: us);
3. offer the state to the destination (a NATS request) and, once accepted, send it;
4. wait for the destination's outcome: committed (ownership moved at e+2) -> ``release``;
5. anything else before the commit -> abort: CAS migrating -> executing|suspended, expected
   e+1 (epoch e+2, owner: us), ``unfreeze``. If that CAS loses, the destination's commit won
   (both expect e+1, exactly one succeeds): the registry says so, and we release.

The report goes to ``<prefix>.worker.<src>.migrations`` and the registry's cluster events either way.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from shared.states import SessionState
from shared.wire import (
    HandoffAnswer,
    HandoffOffer,
    HandoffOutcome,
    MigrationReport,
    WorkerCmdKind,
    WorkerCommand,
)

from .codes import HandoffCode
from .host import FrozenSession, HostRefused
from .io import HandoffIO, NoAnswer, RegistryDown, RegistryLost
from .links import SEND
from .protocol import (
    Action,
    Closing,
    Done,
    Effect,
    Event,
    Failed,
    Lost,
    Outcome,
    Report,
    Seen,
    SourceProtocol,
    SourceState,
    Step,
    as_code,
)
from .rendezvous import new_link_id
from .selection import Place
from .stats import HandoffSample
from .tensors import checksum, digest_context, new_secret, spec_of, tensors_of
from .transports import TransferError

_ABORT_RETRY_S = 0.2
# While the machine is in these states the destination may send an outcome, and the link to
# it carries this transfer (one at a time per peer).
_TALKING = (SourceState.OFFERING, SourceState.SENDING, SourceState.AWAITING)
_LOCKED = (SourceState.OFFERING, SourceState.SENDING)


def state_place(device: str, worker: Place) -> Place:
    """Where a frozen state is, as its offer says: ``device`` of its tensors (a CUDA
    worker's executing session is frozen on the device, a suspended one in host memory) and,
    on the device, the worker's GPU UUID, from which the destination picks the transport."""
    if device.startswith("cuda"):
        return Place(device=device, uuid=worker.uuid)
    return Place(device=device)


class Migration:
    def __init__(self, io: HandoffIO, cmd: WorkerCommand) -> None:
        self.io = io
        self.cmd = cmd
        self.sid = cmd.session_id or ""
        self.dst = cmd.target or ""
        self.started = time.perf_counter()
        self.deadline = time.monotonic() + io.timeout_s
        self.transfer_id = uuid.uuid4().hex
        self.protocol = SourceProtocol(io.worker_id, self.dst, cmd.epoch)
        self.frozen: FrozenSession | None = None
        self.offer: HandoffOffer | None = None
        self.answer: HandoffAnswer | None = None
        self.transport = ""
        self.nbytes = 0
        self._t_offer = 0.0
        self._lock: asyncio.Lock | None = None  # the peer's send lock, while held
        self._outcome: asyncio.Future[HandoffOutcome] | None = None
        self._unfinished: list[Action] = []  # what is left of the batch being carried out
        self.ms = {"freeze": 0.0, "offer": 0.0, "connect": 0.0, "transfer": 0.0, "commit": 0.0}

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def refuse(self, code: HandoffCode, detail: str) -> MigrationReport:
        report = await self._carry_out(self.protocol.refuse(code, detail))
        assert report is not None
        return report

    async def run(self) -> MigrationReport:
        actions = self.protocol.start(self._check_command())
        try:
            return await self._drive(actions)
        except asyncio.CancelledError:
            self._unlock()
            if self.protocol.state is SourceState.DONE and self._unfinished:
                # Cut off while ending (a release, an unfreeze, the report): finish the end,
                # from the action that was cut, whatever else gets cancelled meanwhile.
                await asyncio.shield(self._carry_out(self._unfinished))
            elif self.protocol.state not in (SourceState.NEW, SourceState.FREEZING):
                # The worker is closing after the freeze (which is cancellation-safe, by
                # StateHost's contract): give the session back.
                await asyncio.shield(self._drive(self.protocol.handle(Closing())))
            raise
        finally:
            self._unlock()
            self.io.forget_outcome(self.transfer_id)

    async def _drive(self, actions: list[Action]) -> MigrationReport:
        """Carry out actions and feed back their events until the protocol reports."""
        while True:
            report = await self._carry_out(actions)
            if report is not None:
                return report
            step = next(a for a in actions if isinstance(a, Step))
            event = await self._step(step)
            actions = self.protocol.handle(event)
            if self.protocol.state not in _LOCKED:
                self._unlock()
            if self.protocol.state not in _TALKING:
                self.io.forget_outcome(self.transfer_id)

    async def _carry_out(self, actions: list[Action]) -> MigrationReport | None:
        for i, action in enumerate(actions):
            self._unfinished = actions[i:]
            if isinstance(action, Effect):
                await self._effect(action)
            elif isinstance(action, Report):
                report = await self._done(action)
                self._unfinished = []
                return report
        self._unfinished = []
        return None

    def _check_command(self) -> str:
        cmd = self.cmd
        if cmd.kind is not WorkerCmdKind.MIGRATE:
            return f"a {cmd.kind} command is not a migration"
        if not self.sid or not self.dst:
            return "a migration needs session_id and target"
        if self.dst == self.io.worker_id:
            return f"the target {self.dst} is this worker"
        return ""

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- the steps ------------------------------------------------------------------------
    async def _step(self, step: Step) -> Event:
        if step is Step.FREEZE:
            return await self._freeze()
        if step is Step.CLAIM:
            self._t_offer = time.perf_counter()
            return await self._move(self.protocol.epoch, migrating=True)
        if step is Step.OFFER:
            return await self._offer()
        if step is Step.SEND:
            return await self._send()
        if step is Step.AWAIT_OUTCOME:
            return await self._await_outcome()
        if step is Step.TAKE_BACK:
            return await self._take_back()
        if step is Step.READ:
            try:
                record = await self.io.read(self.sid)
            except RegistryDown as exc:
                return Failed(HandoffCode.REGISTRY_UNAVAILABLE, str(exc))
            return Seen(None) if record is None else Seen(record.state, record.owner, record.epoch)
        raise AssertionError(f"the source has no step {step}")

    async def _freeze(self) -> Event:
        io = self.io
        on_device = io.place.on_cuda and io.preferred_transport != "gloo"
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.left()):
                frozen = await io.host.freeze(self.sid, self.protocol.epoch, on_device=on_device)
        except HostRefused as exc:
            return Failed(exc.code, exc.detail)
        except TimeoutError:
            return Failed(HandoffCode.TIMEOUT, "the session did not reach a chunk boundary")
        except Exception as exc:  # noqa: BLE001 - a failed freeze is reported, not raised
            io.log.error("freeze_failed", session_id=self.sid, error=repr(exc), exc_info=exc)
            return Failed(HandoffCode.HOST_ERROR, f"freeze: {exc!r}")
        self.ms["freeze"] = (time.perf_counter() - t0) * 1000.0
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors_of(frozen.snapshot))
        self.frozen = frozen
        self.protocol.frozen(frozen.suspended)
        return Done()

    async def _move(self, expected_epoch: int, *, migrating: bool) -> Event:
        """The claim (to migrating) or the take-back (to the state before)."""
        state = SessionState.MIGRATING if migrating else self.protocol.back_state()
        try:
            record = await self.io.move(self.sid, state, expected_epoch, self.io.worker_id)
        except RegistryLost as exc:
            return Failed(HandoffCode.STALE_EPOCH, str(exc)) if migrating else Lost(str(exc))
        except RegistryDown as exc:
            return Failed(HandoffCode.REGISTRY_UNAVAILABLE, str(exc))
        return Done(record.epoch)

    async def _offer(self) -> Event:
        io, frozen = self.io, self.frozen
        assert frozen is not None
        self._outcome = io.expect_outcome(self.transfer_id)
        lock = io.send_lock(self.dst)
        await lock.acquire()
        self._lock = lock
        self.offer = offer = await self._make_offer(frozen)
        try:
            answer = await io.ask(offer, max(self.left(), 0.001))
        except NoAnswer as exc:
            return Failed(HandoffCode.UNREACHABLE, exc.detail, delivered=exc.delivered)
        if not answer.accepted:
            return Failed(as_code(answer.code), answer.detail or f"{self.dst} refused")
        self.ms["offer"] = (time.perf_counter() - self._t_offer) * 1000.0
        self.answer = answer
        return Done()

    async def _make_offer(self, frozen: FrozenSession) -> HandoffOffer:
        io, snap = self.io, frozen.snapshot
        tensors = tensors_of(snap)
        held = state_place(str(tensors[0].device) if tensors else "cpu", io.place)
        rendezvous = {
            "store": io.address,
            "device": held.device,
            "uuid": held.uuid,
            "new_link": new_link_id(),
            "tag": str(io.next_tag()),
        }
        for transport, link_id in io.links.ids(self.dst, SEND).items():
            rendezvous[f"link.{transport}"] = link_id
        secret = digest = ""
        if io.checksum:  # a pass over every byte: off the loop
            secret = new_secret()
            context = digest_context(
                self.transfer_id, self.sid, self.protocol.epoch, io.worker_id, self.dst
            )
            digest = await io.run(checksum, tensors, secret, context)
        return HandoffOffer(
            transfer_id=self.transfer_id,
            session_id=self.sid,
            epoch=self.protocol.epoch,
            src=io.worker_id,
            dst=self.dst,
            transport=io.preferred_transport,
            rendezvous=rendezvous,
            tensors=[spec_of(t) for t in tensors],
            nbytes=self.nbytes,
            checksum=digest,
            secret=secret,
            suspended=frozen.suspended,
            next_seq=frozen.next_seq,
            engine_seq=snap.seq,
            position=snap.position,
            prompt=snap.prompt,
            pending_prompt=snap.pending_prompt,
            seed=snap.seed,
            input=snap.input,
            strength=snap.strength,
            preset=snap.preset,
            dtype=snap.dtype,
            meta=dict(snap.meta),
            due_at=frozen.due_at,
            command_id=self.cmd.command_id,
        )

    async def _send(self) -> Event:
        io, frozen, offer, answer = self.io, self.frozen, self.offer, self.answer
        assert frozen is not None and offer is not None and answer is not None
        try:
            transport = io.transport(answer.transport)
        except ValueError:
            return Failed(HandoffCode.TRANSFER_FAILED, f"unknown transport {answer.transport!r}")
        self.transport = transport.name
        link_id = answer.rendezvous.get("link", "")
        cached = io.links.get(self.dst, SEND, transport.name)
        if link_id != offer.rendezvous["new_link"] and (
            cached is None
            or link_id != offer.rendezvous.get(f"link.{transport.name}")
            or cached.link_id != link_id
        ):
            # Not the new link, nor the cached one we offered (it may have been torn down
            # since): building it would wait for a destination that reuses its own.
            return Failed(
                HandoffCode.TRANSFER_FAILED,
                f"the answer names link {link_id!r}, which this worker does not hold",
            )
        link = None
        try:
            link = await io.links.open(
                self.dst,
                SEND,
                transport,
                link_id,
                io.address,
                io.link_device(transport.name),
                self.deadline,
            )
            if link is not cached:
                self.ms["connect"] = link.connect_ms
            t0 = time.perf_counter()
            await io.run(
                transport.send,
                link.handle,
                tensors_of(frozen.snapshot),
                int(offer.rendezvous["tag"]),
                self.deadline,
            )
            self.ms["transfer"] = (time.perf_counter() - t0) * 1000.0
        except TransferError as exc:
            if link is not None:
                await io.links.drop(link)
            return Failed(HandoffCode.TRANSFER_FAILED, str(exc))
        return Done()

    async def _await_outcome(self) -> Event:
        assert self._outcome is not None
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.left()):
                outcome = await self._outcome
        except TimeoutError:
            return Failed(HandoffCode.TIMEOUT, "no outcome from the destination")
        self.ms["commit"] = (time.perf_counter() - t0) * 1000.0
        return Outcome(outcome.committed, outcome.epoch, outcome.code, outcome.detail)

    async def _take_back(self) -> Event:
        """The take-back's CAS, tried again while the registry is away, up to the budget."""
        retry_until = time.monotonic() + self.io.timeout_s
        while True:
            event = await self._move(self.protocol.epoch, migrating=False)
            if not isinstance(event, Failed) or time.monotonic() > retry_until:
                if isinstance(event, Failed):
                    self.io.log.error("abort_not_written", session_id=self.sid, error=event.detail)
                return event
            await asyncio.sleep(_ABORT_RETRY_S)

    # -- the effects and the end ----------------------------------------------------------
    async def _effect(self, effect: Effect) -> None:
        io = self.io
        if effect is Effect.UNFREEZE:
            await io.host.unfreeze(self.sid, self.protocol.epoch)
        elif effect is Effect.RELEASE:
            await io.host.release(self.sid)
        elif effect is Effect.RECORD:
            io.record(
                HandoffSample(
                    nbytes=self.nbytes,
                    offer_ms=self.ms["offer"],
                    transfer_ms=self.ms["transfer"],
                    commit_ms=self.ms["commit"],
                    connect_ms=self.ms["connect"],
                )
            )
        elif effect is Effect.NOTIFY_ABORT:
            # The destination discards now rather than at its deadline; the transfer may have
            # stopped half-way, so both sides drop their link (rebuilt on next use).
            code, detail = self.protocol.why
            await io.tell(
                self.dst,
                HandoffOutcome(
                    transfer_id=self.transfer_id,
                    session_id=self.sid,
                    committed=False,
                    epoch=self.protocol.epoch,
                    code=HandoffCode.ABORTED,
                    detail=f"{code}: {detail}",
                ),
            )
            link = io.links.get(self.dst, SEND, self.transport) if self.transport else None
            if link is not None:
                await io.links.drop(link)
        else:
            raise AssertionError(f"the source has no effect {effect}")

    async def _done(self, end: Report) -> MigrationReport:
        io = self.io
        report = MigrationReport(
            session_id=self.sid or "-",
            src=io.worker_id,
            dst=self.dst or "-",
            ok=end.ok,
            command_id=self.cmd.command_id,
            code=str(end.code) if end.code else "",
            detail=end.detail,
            epoch=end.epoch,
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
        io.log.info(
            "migration",
            session_id=report.session_id,
            dst=report.dst,
            ok=end.ok,
            code=report.code,
            detail=end.detail,
            epoch=report.epoch,
            nbytes=self.nbytes,
            transport=self.transport,
            total_ms=round(report.total_ms, 2),
        )
        await io.report(report)
        return report

"""One object per worker that serves both roles of a session-state handoff.

    endpoint = HandoffEndpoint(nc, registry, subjects, host, settings)
    await endpoint.start()              # rendezvous store + <prefix>.worker.<id>.handoff
    report = await endpoint.migrate(cmd)  # source role, on a MIGRATE command
    endpoint.cost()                     # heartbeat figures: fixed ms, ms per MiB
    await endpoint.forget_peer(wid)     # a peer left: tear its links down
    await endpoint.close()

The destination role needs no call: offers arrive on the worker's handoff subject. The
protocol's state tables are in :mod:`.protocol`, their drivers in :mod:`.source` and
:mod:`.destination`, which reach the endpoint only as the narrow :class:`~.io.HandoffIO` it
implements (the NATS connection and the registry stay here); ``docs/migration.md`` tells the
protocol as a numbered sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

import msgspec
import nats.errors
import redis.exceptions
import torch
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.logging import get_logger
from shared.registry import Registry, SessionNotFound, SessionRecord, StaleEpoch
from shared.runner import subscriptions_live
from shared.settings import WorkerSettings
from shared.states import IllegalTransition, SessionState
from shared.supervisor import Supervisor
from shared.wire import (
    HandoffAnswer,
    HandoffMsg,
    HandoffOffer,
    HandoffOutcome,
    MigrationReport,
    Subjects,
    WorkerCommand,
    decode,
    decode_or_drop,
    encode,
    sent_by,
    subject_sender,
)

from .codes import HandoffCode
from .destination import Reception
from .host import StateHost
from .io import NoAnswer, RegistryDown, RegistryLost
from .links import Links
from .rendezvous import StoreClients, StoreServer
from .selection import GLOO, TRANSPORTS, Place
from .source import Migration
from .stats import HandoffCost, HandoffSample, HandoffStats
from .tensors import TAGS_PER_TRANSFER
from .transports import Transport, make_transport

T = TypeVar("T")
_THREADS = 16  # blocking transfers, link builds and teardowns; a stuck one ends at its deadline
_TAG_SPAN = 1 << 20  # transfer tags cycle below 2**20 * TAGS_PER_TRANSFER = 2**30
_CAS_ERRORS = (StaleEpoch, IllegalTransition, SessionNotFound)


class HandoffEndpoint:
    def __init__(
        self,
        nc: NATS,
        registry: Registry,
        subjects: Subjects,
        host: StateHost,
        settings: WorkerSettings,
        *,
        checksum: bool = True,
        stats_keep: int = 32,
    ) -> None:
        self.nc = nc
        self.registry = registry
        self.subjects = subjects
        self.host = host
        self.settings = settings
        self.worker_id = host.worker_id
        # Every offer carries a one-time secret and the state's checksum under it, and an
        # offer here must: only state that matches is adopted. It costs a pass over the bytes
        # on both sides; off only to measure that cost (``bench migration --no-checksum``).
        self.checksum = checksum
        self.timeout_s = settings.handoff_timeout_s
        self.preferred_transport = settings.handoff_transport
        self.bind_host = settings.handoff_address()  # resolved once (``auto``: a DNS lookup)
        self.log = get_logger("turboserve.handoff").bind(worker_id=self.worker_id)
        self.place = device_place(host.device)
        self._executor = ThreadPoolExecutor(_THREADS, thread_name_prefix="handoff")
        self._server: StoreServer | None = None
        self._clients = StoreClients(self.timeout_s)
        self._links: Links | None = None
        self._transports: dict[str, Transport] = {}
        self._send_locks: dict[str, asyncio.Lock] = {}
        self._tags = itertools.count(1)
        self._stats = HandoffStats(stats_keep)
        self._sub: Any = None
        self._tasks = Supervisor("handoff_task_failed", log=self.log)
        self._outcomes: dict[str, asyncio.Future[HandoffOutcome]] = {}  # source: by transfer id
        self._peers: dict[str, str] = {}  # source: each transfer's destination, by transfer id
        self.reception = Reception(self)
        self.closing = False

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self._server = await self.run(StoreServer, self.bind_host, s.handoff_port, self.timeout_s)
        self._links = Links(self.run, self._server, self._clients)
        self._sub = await self.nc.subscribe(
            self.subjects.worker_handoffs_to(self.worker_id), cb=self._on_message
        )
        await subscriptions_live(self.nc)  # offers sent from now on reach us
        self.log.info(
            "handoff_ready",
            address=self.address,
            device=self.place.device,
            transport=s.handoff_transport,
        )

    async def close(self) -> None:
        """Refuse new offers and migrations, let the handoffs in flight finish or abort (each
        ends by its deadline; outcomes still arrive meanwhile), cancel what is left (a source
        then aborts its own), tear the links down. Idempotent."""
        if self.closing:
            return
        self.closing = True
        await self._tasks.wait(timeout_s=self.timeout_s + 1.0)
        await self._tasks.cancel(wait_s=self.timeout_s)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._links is not None:
            await self._links.drop_all()
        self._clients.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._server = None

    @property
    def address(self) -> str:
        """Where peers reach this worker's rendezvous (advertise it as ``handoff_addr``)."""
        if self._server is None:
            raise RuntimeError("the handoff endpoint is not started")
        return self._server.address

    @property
    def links(self) -> Links:
        if self._links is None:
            raise RuntimeError("the handoff endpoint is not started")
        return self._links

    # -- the source role ------------------------------------------------------------------
    async def migrate(self, cmd: WorkerCommand) -> MigrationReport:
        """Hand ``cmd.session_id`` to ``cmd.target``; returns the report it also publishes on
        ``<prefix>.worker.<id>.migrations``. Never raises for a failed handoff: the report
        says why."""
        if self.closing:
            return await Migration(self, cmd).refuse(HandoffCode.DRAINING, "shutting down")
        # Its own task: a caller that is cancelled does not cut a handoff in half (it ends,
        # or aborts, and reports); ``close`` cancels it, and it aborts then.
        task = self.spawn(Migration(self, cmd).run(), name=f"migrate-{cmd.session_id}")
        return await asyncio.shield(task)

    def cost(self) -> HandoffCost:
        """The measured cost of recent handoffs from here (for heartbeats)."""
        return self._stats.cost()

    async def forget_peer(self, worker_id: str) -> int:
        """``worker_id`` left the pool: tear down every link with it; returns how many."""
        return await self.links.drop_peer(worker_id)

    # -- the two roles' I/O (HandoffIO) ---------------------------------------------------
    async def move(
        self, session_id: str, state: SessionState, expected_epoch: int, owner: str | None
    ) -> SessionRecord:
        try:
            return await self.registry.transition(
                session_id, state, expected_epoch=expected_epoch, owner=owner
            )
        except _CAS_ERRORS as exc:
            raise RegistryLost(str(exc)) from None
        except redis.exceptions.RedisError as exc:
            raise RegistryDown(str(exc)) from None

    async def read(self, session_id: str) -> SessionRecord | None:
        try:
            return await self.registry.get_session(session_id)
        except redis.exceptions.RedisError as exc:
            raise RegistryDown(str(exc)) from None

    async def ask(self, offer: HandoffOffer, timeout_s: float) -> HandoffAnswer:
        subject = self.subjects.worker_handoff(offer.dst, self.worker_id)
        self._peers[offer.transfer_id] = offer.dst
        try:
            reply = await self.nc.request(subject, encode(offer), timeout=timeout_s)
        except nats.errors.NoRespondersError:
            raise NoAnswer(f"no worker {offer.dst} listens", delivered=False) from None
        except (nats.errors.TimeoutError, TimeoutError):
            # It may have accepted: it gets the abort notice.
            raise NoAnswer(f"{offer.dst} did not answer the offer", delivered=True) from None
        try:
            return decode(reply.subject or subject, reply.data, HandoffAnswer)
        except ValueError as exc:
            raise NoAnswer(f"bad answer: {exc}", delivered=True) from None

    async def tell(self, worker_id: str, outcome: HandoffOutcome) -> None:
        await self.publish(self.subjects.worker_handoff(worker_id, self.worker_id), outcome)

    def expect_outcome(self, transfer_id: str) -> asyncio.Future[HandoffOutcome]:
        future: asyncio.Future[HandoffOutcome] = asyncio.get_running_loop().create_future()
        self._outcomes[transfer_id] = future
        return future

    def forget_outcome(self, transfer_id: str) -> None:
        self._outcomes.pop(transfer_id, None)
        self._peers.pop(transfer_id, None)

    async def report(self, report: MigrationReport) -> None:
        await self.publish(self.subjects.migrations(self.worker_id), report)
        try:
            await self.registry.record_cluster_event(
                "migration",
                session_id=report.session_id,
                src=report.src,
                dst=report.dst,
                ok=report.ok,
                code=report.code,
                nbytes=report.nbytes,
                total_ms=round(report.total_ms, 2),
                command_id=report.command_id,
            )
            await self.registry.bump_counters(
                **{"migrations" if report.ok else "migrations_failed": 1}
            )
        except redis.exceptions.RedisError as exc:
            self.log.warning("cluster_event_failed", error=str(exc))

    # -- plumbing shared by the two roles -------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking call in the endpoint's threads (never on the event loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def transport(self, name: str) -> Transport:
        if name not in TRANSPORTS:
            raise ValueError(f"unknown transport {name!r}")
        if name not in self._transports:
            self._transports[name] = make_transport(name, self.bind_host)
        return self._transports[name]

    def link_device(self, transport: str) -> torch.device:
        """Where a transport's tensors are on this side: the device for NCCL and CUDA IPC,
        host memory for gloo."""
        return torch.device("cpu") if transport == GLOO else torch.device(self.place.device)

    def send_lock(self, peer: str) -> asyncio.Lock:
        """One handoff at a time to each peer: its link carries one transfer at a time."""
        return self._send_locks.setdefault(peer, asyncio.Lock())

    def next_tag(self) -> int:
        return (next(self._tags) % _TAG_SPAN) * TAGS_PER_TRANSFER

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """A tracked task (cancelled by ``close``); its failure is logged, never lost."""
        return self._tasks.spawn(coro, name)

    def record(self, sample: HandoffSample) -> None:
        self._stats.add(sample)

    async def publish(self, subject: str, msg: msgspec.Struct) -> None:
        try:
            await self.nc.publish(subject, encode(msg))
        except Exception as exc:  # noqa: BLE001 - a closed connection must not end a handoff
            self.log.warning("handoff_publish_failed", subject=subject, error=str(exc))

    async def _on_message(self, msg: Msg) -> None:
        """Offers (requests) and outcomes on this worker's handoff subjects; a bad message is
        logged and dropped (a bad offer is also refused, so its sender does not wait). The
        subject's last token is the sender (its NATS user may publish only that): an offer
        whose source is another worker, or for another destination, is refused."""
        sender = subject_sender(msg.subject)
        decoded = decode_or_drop(
            msg.subject, msg.data, cast("type[HandoffMsg]", HandoffMsg), self.log
        )
        if isinstance(decoded, HandoffOffer) and not (
            sent_by(msg.subject, decoded.src, sender, self.log) and decoded.dst == self.worker_id
        ):
            if msg.reply:
                await self._answer(
                    msg,
                    HandoffAnswer(
                        transfer_id=decoded.transfer_id,
                        accepted=False,
                        code=HandoffCode.INVALID_OFFER,
                        detail="the offer's source or destination is not its subject's",
                    ),
                )
            return
        if decoded is None:
            if msg.reply:
                await self._answer(
                    msg,
                    HandoffAnswer(
                        transfer_id="",
                        accepted=False,
                        code=HandoffCode.INVALID_OFFER,
                        detail="undecodable offer",
                    ),
                )
        elif isinstance(decoded, HandoffOffer):
            if not msg.reply:
                self.log.warning("offer_without_reply_dropped", session_id=decoded.session_id)
                return
            try:
                answer = await self.reception.consider(decoded)
            except Exception as exc:  # noqa: BLE001 - refuse, and keep serving other offers
                self.log.error(
                    "offer_failed", session_id=decoded.session_id, error=repr(exc), exc_info=exc
                )
                answer = HandoffAnswer(
                    transfer_id=decoded.transfer_id,
                    accepted=False,
                    code=HandoffCode.HOST_ERROR,
                    detail=repr(exc),
                )
            await self._answer(msg, answer)
        else:
            self._on_outcome(decoded, sender)

    async def _answer(self, msg: Msg, answer: HandoffAnswer) -> None:
        try:
            await msg.respond(encode(answer))
        except Exception as exc:  # noqa: BLE001 - the source gave up: it aborts on its own
            self.log.warning("answer_failed", transfer_id=answer.transfer_id, error=str(exc))

    def _on_outcome(self, outcome: HandoffOutcome, sender: str) -> None:
        future = self._outcomes.get(outcome.transfer_id)
        if future is not None:
            if not sent_by("outcome", sender, self._peers.get(outcome.transfer_id, ""), self.log):
                return
            if not future.done():
                future.set_result(outcome)
            return
        if not self.reception.abort_notice(outcome, sender):
            self.log.info(
                "late_outcome_dropped",
                transfer_id=outcome.transfer_id,
                session_id=outcome.session_id,
            )


def device_place(device: str) -> Place:
    """Where this worker keeps device state: its device and, on CUDA, the GPU's UUID."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return Place(device=str(dev))
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", "")
    return Place(device=f"cuda:{index}", uuid=str(uuid) if uuid else "")

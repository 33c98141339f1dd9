"""A NATS user per worker: the credential the provisioner makes for each worker it starts, and
its answer to the server's auth callout for the workers' connections.

The NATS server (``auth_callout`` in its config, shared/security.py) admits the gateway,
scheduler, provisioner and operator by their passwords, and hands every other connection to
``$SYS.REQ.USER.AUTH``, where the provisioner answers (a queue group: any replica may). A
worker connects as its id with the password made for it at launch (:meth:`WorkerCredentials.
mint`); the provisioner checks it against Redis and admits the connection as a user whose
permissions name that id only (``worker_permissions``): its own commands and handoff messages
to read, heartbeats and reports on its own subjects to publish. Anything else is refused:
an unknown id, a wrong password, a credential revoked when its worker stopped or was lost.

The password is kept only as its SHA-256 (in ``<ns>:worker_credentials``, id -> digest): a
Redis reader learns no credential. A connection admitted lives until it closes (its user does
not expire: nats-py would close the connection for good, not reconnect); a revoked credential
is refused at the worker's next connection, and a worker refused for a minute exits, for its
supervisor to start it again (shared/runner.py).

A worker the provisioner did not start (compose's fixed pool) asks for its credential itself:
:class:`Enrolment` answers ``<p>.provisioner.enrol`` (shared/enrol.py). The service decides
whom it admits (an id no live worker holds and it did not launch) and revokes an enrolled
worker's credential once its heartbeats stop.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.callout import (
    AUTH_SUBJECT,
    AuthRequest,
    CalloutError,
    IssuerKey,
    auth_response,
    user_jwt,
)
from shared.enrol import (
    ENROL_BAD_REQUEST,
    ENROL_UNAVAILABLE,
    ENROL_USER,
    EnrolError,
    check_public_key,
    seal,
)
from shared.logging import get_logger
from shared.security import ROLES, worker_permissions
from shared.wire import EnrolReply, EnrolRequest, Subjects, decode_or_drop, encode, valid_id

log = get_logger("turboserve.provisioner")

QUEUE = "provisioner"


def _digest(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


class WorkerCredentials:
    """Each started worker's password, by its SHA-256, in one Redis hash."""

    def __init__(self, redis: aioredis.Redis, namespace: str) -> None:
        self.redis = redis
        self.key = f"{namespace}:worker_credentials"

    async def mint(self, worker_id: str) -> str:
        """A new password for ``worker_id`` (any earlier one stops working)."""
        password = secrets.token_urlsafe(24)
        await self.redis.hset(self.key, worker_id, _digest(password))
        return password

    async def revoke(self, worker_id: str) -> None:
        await self.redis.hdel(self.key, worker_id)

    async def ids(self) -> list[str]:
        """Every worker that holds a credential now."""
        return [
            k.decode() if isinstance(k, bytes) else str(k) for k in await self.redis.hkeys(self.key)
        ]

    async def check(self, worker_id: str, password: str) -> bool:
        stored = await self.redis.hget(self.key, worker_id)
        if stored is None:
            return False
        want = stored.decode() if isinstance(stored, bytes) else str(stored)
        return hmac.compare_digest(want, _digest(password))


class _Responder:
    """Answers the requests on one subject, in the provisioners' queue group (any replica may),
    and counts each outcome."""

    # The log event of an answer that could not be sent (the asker gave up on it).
    answer_failed = "answer_failed"

    def __init__(self, nc: Any, subject: str, count: Any = None) -> None:
        self.nc = nc
        self.subject = subject
        self._count = count  # a Counter labelled by outcome, or None
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subject, queue=QUEUE, cb=self._on_request)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_request(self, msg: Any) -> None:
        raise NotImplementedError

    def _counted(self, outcome: str) -> None:
        if self._count is not None:
            self._count.labels(outcome).inc()

    async def _answer(self, msg: Any, data: bytes) -> None:
        try:
            await msg.respond(data)
        except Exception as exc:  # noqa: BLE001 - the asker gave up on this one: it asks again
            log.warning(self.answer_failed, error=repr(exc))


class Callout(_Responder):
    """The provisioner's answer to the server's authorization requests for workers."""

    answer_failed = "auth_answer_failed"

    def __init__(
        self,
        nc: Any,
        key: IssuerKey,
        credentials: WorkerCredentials,
        subjects: Subjects,
        count: Any = None,
    ) -> None:
        super().__init__(nc, AUTH_SUBJECT, count)
        self.key = key
        self.credentials = credentials
        self.subjects = subjects

    async def _on_request(self, msg: Any) -> None:
        try:
            request = AuthRequest.parse(msg.data.decode())
        except (CalloutError, UnicodeDecodeError) as exc:
            # Not the server's (only it publishes here): nothing to answer.
            log.warning("auth_request_dropped", fault=str(exc))
            return
        worker_id = request.user
        try:
            admitted = (
                valid_id(worker_id)
                and worker_id not in ROLES
                and await self.credentials.check(worker_id, request.password)
            )
        except RedisError as exc:
            # Refused for now: the worker's client connects again, and is let in once Redis
            # is back.
            log.warning("worker_credential_unchecked", worker_id=worker_id, error=str(exc))
            self._counted("unavailable")
            await self._answer(msg, auth_response(self.key, request, error="try again"))
            return
        if not admitted:
            log.warning("worker_credential_refused", worker_id=worker_id or None)
            self._counted("refused")
            await self._answer(msg, auth_response(self.key, request, error="not authorized"))
            return
        perms = worker_permissions(self.subjects, worker_id)
        user = user_jwt(
            self.key,
            request,
            worker_id,
            perms.publish,
            perms.subscribe,
            allow_responses=perms.allow_responses,
        )
        self._counted("admitted")
        await self._answer(msg, auth_response(self.key, request, user=user))


# Whether an id may enrol now: None, or the code of the refusal (shared/enrol.py).
Admission = Callable[[str], Awaitable[str | None]]


class Enrolment(_Responder):
    """The provisioner's answer to a worker that asks for its NATS user (shared/enrol.py)."""

    answer_failed = "enrol_answer_failed"

    def __init__(
        self,
        nc: Any,
        credentials: WorkerCredentials,
        subjects: Subjects,
        admission: Admission,
        on_enrolled: Callable[[str], None],
        count: Any = None,
    ) -> None:
        super().__init__(nc, subjects.provisioner_enrol, count)
        self.credentials = credentials
        self.admission = admission
        self.on_enrolled = on_enrolled

    async def _on_request(self, msg: Any) -> None:
        if not msg.reply:
            log.warning("enrol_request_dropped", fault="no reply subject")
            return
        request = decode_or_drop(msg.subject, msg.data, EnrolRequest, log)
        if request is None:
            await self._refuse(msg, "", ENROL_BAD_REQUEST, "not an enrol request")
            return
        wid = request.worker_id
        try:
            check_public_key(request.public_key)
        except EnrolError as exc:
            await self._refuse(msg, wid, ENROL_BAD_REQUEST, str(exc))
            return
        if wid in ROLES or wid == ENROL_USER:
            await self._refuse(msg, wid, ENROL_BAD_REQUEST, "a role's name is not a worker id")
            return
        try:
            refusal = await self.admission(wid)
            if refusal is not None:
                await self._refuse(msg, wid, refusal, "")
                return
            password = await self.credentials.mint(wid)
        except RedisError as exc:
            await self._refuse(msg, wid, ENROL_UNAVAILABLE, f"Redis: {exc}")
            return
        self.on_enrolled(wid)
        self._counted("enrolled")
        log.info("worker_enrolled", worker_id=wid)
        reply = EnrolReply(ok=True, worker_id=wid, sealed=seal(request.public_key, password, wid))
        await self._answer(msg, encode(reply))

    async def _refuse(self, msg: Any, worker_id: str, code: str, detail: str) -> None:
        log.warning("enrol_refused", worker_id=worker_id or None, code=code, detail=detail)
        self._counted(code)
        reply = EnrolReply(ok=False, worker_id=worker_id, code=code, detail=detail)
        await self._answer(msg, encode(reply))

"""A worker the provisioner did not start asks it for a NATS user of its own (shared/enrol.py).

Run before the service starts (``turboserve worker`` with ``TURBOSERVE_ENROL=true``): connect
with ``TURBOSERVE_NATS_URL`` (the ``enrol`` user's), ask ``<p>.provisioner.enrol`` with a fresh
key until the provisioner answers, and return the settings with this worker's own user in the
URL. A refusal that may pass (``worker_alive``: a worker with this id still beats, as after a
quick restart; ``unavailable``) and a provisioner that does not answer are asked again until
``TURBOSERVE_CONNECT_TIMEOUT_S``; any other refusal ends the start.
"""

from __future__ import annotations

import dataclasses

from shared.backoff import retried
from shared.enrol import RETRYABLE_ENROL_CODES, EnrolError, EnrolKey
from shared.logging import get_logger
from shared.runner import ConnectError, connect_nats
from shared.security import with_user
from shared.settings import WorkerSettings
from shared.wire import EnrolReply, EnrolRequest, WireError, decode, encode

log = get_logger("turboserve.worker")

REQUEST_TIMEOUT_S = 5.0


class EnrolRefused(ConnectError):
    """The provisioner will not give this worker a user (a code that does not pass)."""

    retryable = False


class _AskAgain(Exception):
    """No answer, or a refusal that may pass."""


async def enrol(settings: WorkerSettings) -> WorkerSettings:
    """``settings`` with this worker's own NATS user in ``nats_url`` (and ``enrol`` off).
    Raises :class:`ConnectError` (exit 2) when it gets none."""
    nc = await connect_nats(settings, f"turboserve-worker-enrol-{settings.worker_id}")
    key = EnrolKey()
    wid = settings.worker_id
    request = encode(EnrolRequest(worker_id=wid, public_key=key.public))
    subject = settings.subjects.provisioner_enrol

    async def ask() -> str:
        try:
            msg = await nc.request(subject, request, timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - no responders, a timeout: the provisioner is not up yet
            raise _AskAgain(f"no answer from the provisioner: {exc!r}") from None
        try:
            reply = decode(msg.subject, msg.data, EnrolReply)
        except WireError as exc:
            raise _AskAgain(f"an answer that is not an enrol reply: {exc}") from None
        if not reply.ok:
            detail = f"{reply.code}" + (f": {reply.detail}" if reply.detail else "")
            if reply.code in RETRYABLE_ENROL_CODES:
                raise _AskAgain(detail)
            raise EnrolRefused(f"the provisioner refused to enrol worker {wid!r} ({detail})")
        try:
            return key.open(reply.sealed, wid)
        except EnrolError as exc:
            raise EnrolRefused(f"worker {wid!r}: {exc}") from None

    try:
        password = await retried(
            ask,
            "enrol_retry",
            on=_AskAgain,
            first_s=0.5,
            cap_s=5.0,
            within_s=settings.connect_timeout_s,
            say=log.warning,
            worker_id=wid,
        )
    except _AskAgain as exc:
        raise ConnectError(
            f"worker {wid!r} not enrolled within {settings.connect_timeout_s:.0f}s: {exc}"
        ) from None
    finally:
        await nc.close()
    log.info("worker_enrolled", worker_id=wid)
    return dataclasses.replace(
        settings, nats_url=with_user(settings.nats_url, wid, password), enrol=False
    )

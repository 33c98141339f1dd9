"""Enrolment: how a worker that the provisioner did not start gets a NATS user of its own.

Compose's fixed pool (``--scale worker=N``) is started by compose, not by the provisioner, so no
credential is made for it at launch. Such a worker connects once as the ``enrol`` user, whose
only rights are to ask ``<p>.provisioner.enrol`` and to read replies under ``_INBOX.enrol.>``.
It sends its id and a fresh X25519 public key (:class:`EnrolKey`); the provisioner refuses an
id whose worker is alive, mints the id's password (services/provisioner/callout.py) and sends
it back sealed to that key (:func:`seal`: ephemeral X25519, HKDF-SHA256, ChaCha20-Poly1305),
because every holder of the ``enrol`` password can read the replies. The worker then
connects as ``<id>:<password>``, which the auth callout admits with that id's permissions
only. The ``enrol`` password lets its holder claim an id no live worker holds, and nothing
more: no other worker's commands, no heartbeat in another's name.

Pure: the key, the seal, and the codes of a refusal. The messages are in shared/wire.py.
"""

from __future__ import annotations

import base64
import binascii
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

# The user a worker enrols as (NATS only: it has no Redis user).
ENROL_USER = "enrol"

# Why an enrolment was refused (EnrolReply.code).
ENROL_BAD_REQUEST = "bad_request"  # no valid id, a role's name, or no valid key
ENROL_WORKER_ALIVE = "worker_alive"  # a worker with this id beat within the last seconds
ENROL_LAUNCHED = "launched_here"  # a worker the provisioner launched: made at its launch
ENROL_UNKNOWN_WORKER = "unknown_worker"  # its workers enrol (pods): not one it launched
ENROL_UNAVAILABLE = "unavailable"  # Redis could not store the credential: ask again
# Refusals that may pass (the old worker's heartbeats stop, Redis comes back).
RETRYABLE_ENROL_CODES = frozenset({ENROL_WORKER_ALIVE, ENROL_UNAVAILABLE})

_KEY_BYTES = 32
_NONCE_BYTES = 12


class EnrolError(ValueError):
    """A key or a sealed credential that cannot be used."""

    retryable = False


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text.encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise EnrolError(f"{what}: not URL-safe base64") from None


def _key(shared: bytes, context: str) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=b"turboserve enrol " + context.encode(),
    ).derive(shared)


def _public(text: str) -> X25519PublicKey:
    raw = _unb64(text, "public key")
    if len(raw) != _KEY_BYTES:
        raise EnrolError(f"public key: {len(raw)} bytes, not {_KEY_BYTES}")
    return X25519PublicKey.from_public_bytes(raw)


def check_public_key(text: str) -> None:
    """Raises :class:`EnrolError` unless ``text`` is an X25519 public key as sent."""
    _public(text)


def seal(public_key: str, secret: str, context: str) -> str:
    """``secret`` readable only by the holder of ``public_key``'s private half; ``context``
    (the worker id) is bound in, so a sealed secret cannot pass for another id's."""
    ephemeral = X25519PrivateKey.generate()
    key = _key(ephemeral.exchange(_public(public_key)), context)
    nonce = os.urandom(_NONCE_BYTES)
    sealed = ChaCha20Poly1305(key).encrypt(nonce, secret.encode(), context.encode())
    return _b64(ephemeral.public_key().public_bytes_raw() + nonce + sealed)


class EnrolKey:
    """The worker's one-time key pair for one enrolment."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()

    @property
    def public(self) -> str:
        return _b64(self._private.public_key().public_bytes_raw())

    def open(self, sealed: str, context: str) -> str:
        raw = _unb64(sealed, "sealed credential")
        if len(raw) <= _KEY_BYTES + _NONCE_BYTES:
            raise EnrolError("sealed credential: too short")
        peer = X25519PublicKey.from_public_bytes(raw[:_KEY_BYTES])
        nonce, body = raw[_KEY_BYTES : _KEY_BYTES + _NONCE_BYTES], raw[_KEY_BYTES + _NONCE_BYTES :]
        key = _key(self._private.exchange(peer), context)
        try:
            return ChaCha20Poly1305(key).decrypt(nonce, body, context.encode()).decode()
        except (InvalidTag, UnicodeDecodeError):
            raise EnrolError("sealed credential: not sealed to this key for this id") from None

    def __repr__(self) -> str:
        return "EnrolKey(...)"

"""NATS auth callout, the pure part: the issuer's key, and the JWTs of the exchange.

With an ``auth_callout`` block, nats-server hands every connection whose user is not one of its
``auth_users`` to a service: it sends an authorization request (a JWT) on
``$SYS.REQ.USER.AUTH``, and admits the client only with an authorization response signed by
the configured issuer, carrying a user JWT with that connection's permissions. TurboServe's
provisioner is that service for the workers (services/provisioner/callout.py): each worker gets
a user of its own, named by its id, with permissions that name its id.

The issuer is an Ed25519 key. The server knows its public half as an account nkey (``A...``:
base32 of a prefix byte, the key and a CRC-16); the provisioner holds its private half
(``TURBOSERVE_CALLOUT_KEY``, 32 bytes in URL-safe base64). JWTs are nats-server's: a header
``{"typ":"JWT","alg":"ed25519-nkey"}``, claims, and an Ed25519 signature over the two, each part
URL-safe base64 without padding.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

# The account nkey's prefix byte (its base32 starts with "A").
_ACCOUNT_PREFIX = 0
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
# Where a callout user lands in server configuration mode: the global account.
GLOBAL_ACCOUNT = "$G"


class CalloutError(ValueError):
    """A key or a JWT that cannot be used."""

    retryable = False


def _crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the checksum of an nkey."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True, repr=False)
class IssuerKey:
    """The key that signs the callout's answers (``repr`` shows only its public half)."""

    seed: bytes  # the Ed25519 private key, 32 bytes

    @classmethod
    def generate(cls) -> IssuerKey:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_text(cls, text: str) -> IssuerKey:
        try:
            seed = _unb64(text.strip())
        except (ValueError, TypeError):
            seed = b""
        if len(seed) != 32:
            raise CalloutError("the callout key: 32 bytes in URL-safe base64 (43 characters)")
        return cls(seed)

    def text(self) -> str:
        return _b64(self.seed)

    def _private(self) -> Any:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: PLC0415
            Ed25519PrivateKey,
        )

        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def public_nkey(self) -> str:
        """The account nkey the server's ``auth_callout { issuer }`` names."""
        from cryptography.hazmat.primitives.serialization import (  # noqa: PLC0415
            Encoding,
            PublicFormat,
        )

        raw = self._private().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        body = bytes([_ACCOUNT_PREFIX]) + raw
        return base64.b32encode(body + _crc16(body).to_bytes(2, "little")).decode().rstrip("=")

    def sign_jwt(self, claims: dict[str, Any]) -> str:
        head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        signature = self._private().sign(f"{head}.{body}".encode())
        return f"{head}.{body}.{_b64(signature)}"

    def __repr__(self) -> str:
        return f"IssuerKey({self.public_nkey})"


def jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT (its signature is not checked: the server's request comes over the
    server's own connection, on a subject only it publishes)."""
    try:
        _, body, _ = token.split(".")
        claims = json.loads(_unb64(body))
    except (ValueError, TypeError) as exc:
        raise CalloutError(f"not a JWT: {exc}") from None
    if not isinstance(claims, dict):
        raise CalloutError("not a JWT: its claims are not an object")
    return claims


def _jti(claims: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    return base64.b32encode(digest).decode().rstrip("=")


@dataclass(frozen=True, slots=True)
class AuthRequest:
    """What a connection asked with: the server's id, the nkey it made for the connection,
    and the user and password the client sent."""

    server_id: str
    user_nkey: str
    user: str
    password: str

    @classmethod
    def parse(cls, token: str) -> AuthRequest:
        claims = jwt_claims(token)
        nats = claims.get("nats")
        if not isinstance(nats, dict):
            raise CalloutError("an authorization request without its nats claims")
        server = nats.get("server_id") or {}
        opts = nats.get("connect_opts") or {}
        server_id, user_nkey = server.get("id"), nats.get("user_nkey")
        if not isinstance(server_id, str) or not isinstance(user_nkey, str):
            raise CalloutError("an authorization request without a server id or user nkey")
        return cls(
            server_id=server_id,
            user_nkey=user_nkey,
            user=str(opts.get("user") or ""),
            password=str(opts.get("pass") or ""),
        )


def user_jwt(
    key: IssuerKey,
    request: AuthRequest,
    name: str,
    publish: tuple[str, ...],
    subscribe: tuple[str, ...],
    *,
    allow_responses: bool,
    now: float | None = None,
) -> str:
    """The user a connection becomes: named ``name``, allowed ``publish`` and ``subscribe``
    only. It does not expire: nats-py closes a connection whose user expired for good instead
    of reconnecting, so a revoked credential is refused at the worker's next connection."""
    issued = int(time.time() if now is None else now)
    nats: dict[str, Any] = {
        "pub": {"allow": list(publish)},
        "sub": {"allow": list(subscribe)},
        "subs": -1,
        "data": -1,
        "payload": -1,
        "type": "user",
        "version": 2,
    }
    if allow_responses:
        nats["resp"] = {"max": 1, "ttl": 0}
    claims: dict[str, Any] = {
        "iat": issued,
        "iss": key.public_nkey,
        "name": name,
        "sub": request.user_nkey,
        "aud": GLOBAL_ACCOUNT,
        "nats": nats,
    }
    claims["jti"] = _jti(claims)
    return key.sign_jwt(claims)


def auth_response(
    key: IssuerKey,
    request: AuthRequest,
    *,
    user: str | None = None,
    error: str | None = None,
    now: float | None = None,
) -> bytes:
    """The answer to ``request``: the user JWT that admits it, or the error that refuses it."""
    issued = int(time.time() if now is None else now)
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if user is not None:
        nats["jwt"] = user
    else:
        nats["error"] = error or "not authorized"
    claims: dict[str, Any] = {
        "iat": issued,
        "iss": key.public_nkey,
        "sub": request.user_nkey,
        "aud": request.server_id,
        "nats": nats,
    }
    claims["jti"] = _jti(claims)
    return key.sign_jwt(claims).encode()

"""Who may do what: API keys create sessions, a session's token is needed for everything about
that session, the operator key opens the cluster view and any session.

Credentials travel as ``Authorization: Bearer <secret>``; a session token may also come as the
``token`` query parameter, since browsers cannot set headers on ``EventSource`` or WebSocket.
Secrets are compared as SHA-256 digests in constant time against every candidate, never logged,
and a session's token is stored only as its digest.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from aiohttp import web

from services.gateway import errors
from shared.registry import SessionRecord

# The key name sessions are counted against when no API key is configured.
ANONYMOUS = "anonymous"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_session_token() -> tuple[str, str]:
    """A fresh session token and the digest the registry keeps of it."""
    token = secrets.token_urlsafe(32)
    return token, digest(token)


def _matches(given_digest: str, stored_digest: str) -> bool:
    return hmac.compare_digest(given_digest.encode(), stored_digest.encode())


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The configured API keys (name -> digest) and the operator key's digest."""

    api_keys: dict[str, str]
    operator: str | None

    @classmethod
    def from_secrets(cls, api_keys: dict[str, str], operator_key: str) -> KeyRing:
        return cls(
            {name: digest(key) for name, key in api_keys.items()},
            digest(operator_key) if operator_key else None,
        )

    @property
    def open(self) -> bool:
        """No API key configured: anyone may create sessions."""
        return not self.api_keys

    def api_key_name(self, secret: str) -> str | None:
        given = digest(secret)
        found = None
        for name, stored in self.api_keys.items():  # no early exit: the time says nothing
            if _matches(given, stored):
                found = name
        return found

    def is_operator(self, secret: str) -> bool:
        return self.operator is not None and _matches(digest(secret), self.operator)


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def require_api_key(keys: KeyRing, request: web.Request) -> str:
    """The name of the API key the request carries (:data:`ANONYMOUS` when none is configured)."""
    if keys.open:
        return ANONYMOUS
    secret = bearer(request)
    if secret is None:
        raise errors.Unauthorized("an API key is needed: Authorization: Bearer <key>")
    name = keys.api_key_name(secret)
    if name is None:
        if keys.is_operator(secret):
            raise errors.Forbidden("the operator key cannot create sessions; use an API key")
        raise errors.Unauthorized("unknown API key")
    return name


def require_operator(keys: KeyRing, request: web.Request) -> None:
    secret = bearer(request)
    if secret is None:
        raise errors.Unauthorized("the operator key is needed: Authorization: Bearer <key>")
    if keys.is_operator(secret):
        return
    if keys.operator is None:
        raise errors.Forbidden("no operator key is configured (TURBOSERVE_OPERATOR_KEY)")
    if keys.api_key_name(secret) is not None:
        raise errors.Forbidden("an API key does not open operator routes")
    raise errors.Unauthorized("wrong operator key")


def authorize_session(keys: KeyRing, request: web.Request, record: SessionRecord) -> bool:
    """Check the request may act on ``record``: its token or the operator key, in the header or
    (the token) in the query. Returns True for the operator. 401 without any credential, 403
    when none of those given opens this session."""
    given = [s for s in (bearer(request), request.query.get("token")) if s]
    if not given:
        raise errors.Unauthorized(
            "this session's token is needed: Authorization: Bearer <token> or ?token=<token>"
        )
    if any(keys.is_operator(secret) for secret in given):
        return True
    if record.token_hash and any(_matches(digest(secret), record.token_hash) for secret in given):
        return False
    raise errors.Forbidden("this credential does not open this session", session_id=record.id)

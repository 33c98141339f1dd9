"""The auth callout's pure part: the issuer's nkey and the JWTs the server reads (the server's
own acceptance of them is tested against a real nats-server in tests/security)."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from shared.callout import (
    AuthRequest,
    CalloutError,
    IssuerKey,
    _crc16,
    auth_response,
    jwt_claims,
    user_jwt,
)
from shared.settings import ProvisionerSettings, SettingsError


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def request_jwt(user: str = "w1", password: str = "pw") -> str:
    claims = {
        "nats": {
            "server_id": {"id": "NSERVER"},
            "user_nkey": "UCONNECTION",
            "connect_opts": {"user": user, "pass": password},
        }
    }
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"e30.{body}.sig"


def test_the_public_nkey_is_an_account_key_with_its_checksum():
    key = IssuerKey.generate()
    nkey = key.public_nkey
    assert nkey.startswith("A") and len(nkey) == 56
    raw = base64.b32decode(nkey + "=" * (-len(nkey) % 8))
    assert raw[0] == 0 and len(raw) == 35
    assert int.from_bytes(raw[-2:], "little") == _crc16(raw[:-2])
    assert IssuerKey.from_text(key.text()).public_nkey == nkey
    assert key.text() not in repr(key)


def test_crc16_is_xmodem():
    assert _crc16(b"123456789") == 0x31C3  # the CRC-16/XMODEM check value


def test_a_user_jwt_is_signed_by_the_issuer_and_names_the_connection():
    key = IssuerKey.generate()
    request = AuthRequest.parse(request_jwt())
    token = user_jwt(key, request, "w1", ("a.>",), ("b.>",), allow_responses=True, now=1000)
    head, body, signature = token.split(".")
    assert json.loads(unb64(head)) == {"typ": "JWT", "alg": "ed25519-nkey"}
    raw_pub = base64.b32decode(key.public_nkey)[1:33]
    Ed25519PublicKey.from_public_bytes(raw_pub).verify(unb64(signature), f"{head}.{body}".encode())
    claims = jwt_claims(token)
    assert (claims["sub"], claims["aud"], claims["iss"], claims["name"]) == (
        "UCONNECTION",
        "$G",
        key.public_nkey,
        "w1",
    )
    assert claims["iat"] == 1000 and "exp" not in claims  # a user that does not expire
    assert claims["nats"]["pub"] == {"allow": ["a.>"]}
    assert claims["nats"]["resp"] == {"max": 1, "ttl": 0}
    answer = jwt_claims(auth_response(key, request, user=token).decode())
    assert answer["aud"] == "NSERVER" and answer["nats"]["jwt"] == token
    refusal = jwt_claims(auth_response(key, request, error="no").decode())
    assert refusal["nats"]["error"] == "no" and "jwt" not in refusal["nats"]


@pytest.mark.parametrize("token", ["", "a.b", "a.!!!.c", "e30.W10.c", "e30.e30.c"])
def test_a_malformed_request_is_refused_with_a_clear_error(token):
    with pytest.raises(CalloutError):
        AuthRequest.parse(token)


def test_the_callout_key_is_checked_and_masked():
    key = IssuerKey.generate().text()
    settings = ProvisionerSettings.from_env({"TURBOSERVE_CALLOUT_KEY": key})
    assert key not in str(settings)
    with pytest.raises(SettingsError, match="TURBOSERVE_CALLOUT_KEY"):
        ProvisionerSettings.from_env({"TURBOSERVE_CALLOUT_KEY": "short"})
    # Kubernetes pods enrol for their credential (shared/enrol.py): the callout works there too
    assert (
        ProvisionerSettings.from_env(
            {"TURBOSERVE_CALLOUT_KEY": key, "TURBOSERVE_BACKEND": "kubernetes"}
        ).callout_key
        == key
    )

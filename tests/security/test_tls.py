"""The NATS and Redis ``turboserve up`` starts require TLS and the deployment's client
certificate: a plain-text client, and a TLS client without the certificate, are refused before
they can send a password; the services' own client side (shared/tls.py) gets in."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest
import redis.asyncio as aioredis
from nats.errors import NoServersError
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.runner import close_context, open_context
from shared.settings import CommonSettings
from shared.tls import client_context, generate, nats_tls_kwargs, redis_tls_kwargs
from tests.security.conftest import secured_servers
from tools.launcher import Mesh
from tools.servers import probe_redis

pytestmark = pytest.mark.integration

PREFIX = "tlssec"


@pytest.fixture(scope="module")
def tls_infra() -> Iterator[Mesh]:
    yield from secured_servers(PREFIX, tls=True)


def plain(url: str, scheme: str) -> str:
    return urlsplit(url)._replace(scheme=scheme).geturl()


def settings_of(mesh: Mesh) -> CommonSettings:
    assert mesh.tls_files is not None
    return CommonSettings(
        nats_url=mesh.nats_url,
        redis_url=mesh.redis_url,
        subject_prefix=PREFIX,
        redis_namespace=PREFIX,
        connect_timeout_s=10,
        tls_ca_file=mesh.tls_files.ca_file,
        tls_cert_file=mesh.tls_files.cert_file,
        tls_key_file=mesh.tls_files.key_file,
    )


async def test_the_services_client_side_connects_over_tls(tls_infra):
    assert tls_infra.nats_url.startswith("tls://")
    assert tls_infra.redis_url.startswith("rediss://")
    ctx = await open_context(settings_of(tls_infra), "tls-test")
    try:
        await ctx.redis.set(f"{PREFIX}:probe", b"1")
        assert await ctx.redis.get(f"{PREFIX}:probe") == b"1"
        sub = await ctx.nc.subscribe(f"{PREFIX}.tls.probe")
        await ctx.nc.publish(f"{PREFIX}.tls.probe", b"over tls")
        assert (await sub.next_msg(timeout=5)).data == b"over tls"
    finally:
        await close_context(ctx)


def test_a_plain_text_client_is_refused_by_nats(tls_infra):
    # The operator's own password, in plain text: the server answers with an error and hangs
    # up, and never a PONG. (nats-py itself would upgrade to TLS when the server asks.)
    parts = urlsplit(tls_infra.nats_url)
    connect = json.dumps({"user": parts.username, "pass": parts.password, "verbose": False})
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as s:
        info = s.recv(4096).decode()
        assert info.startswith("INFO ") and json.loads(info[5:])["tls_required"]
        s.sendall(f"CONNECT {connect}\r\nPING\r\n".encode())
        reply = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(4096):
                reply += chunk
    assert b"PONG" not in reply
    assert b"TLS Required" in reply or not reply, reply


async def test_a_plain_text_client_is_refused_by_redis(tls_infra):
    client = aioredis.from_url(plain(tls_infra.redis_url, "redis"), socket_connect_timeout=3)
    try:
        with pytest.raises(RedisConnectionError):
            await client.ping()
    finally:
        await client.aclose()
    assert not probe_redis(plain(tls_infra.redis_url, "redis"))


async def test_a_tls_client_without_the_client_certificate_is_refused(tls_infra):
    files = tls_infra.tls_files
    assert files is not None
    no_cert = ssl.create_default_context(cafile=files.ca_file)
    with pytest.raises((NoServersError, OSError, ssl.SSLError, nats.errors.Error)):
        nc = await nats.connect(
            tls_infra.nats_url,
            tls=no_cert,
            allow_reconnect=False,
            connect_timeout=3,
            max_reconnect_attempts=0,
        )
        await nc.close()
    client = aioredis.from_url(
        tls_infra.redis_url, ssl_ca_certs=files.ca_file, socket_connect_timeout=3
    )
    try:
        with pytest.raises(RedisConnectionError):
            await client.ping()
    finally:
        await client.aclose()


async def test_a_certificate_of_another_deployment_is_refused(tls_infra, tmp_path: Path):
    other = generate(tmp_path / "other").client
    with pytest.raises((NoServersError, OSError, ssl.SSLError, nats.errors.Error)):
        nc = await nats.connect(
            tls_infra.nats_url,
            allow_reconnect=False,
            connect_timeout=3,
            max_reconnect_attempts=0,
            **nats_tls_kwargs(tls_infra.nats_url, other),
        )
        await nc.close()
    client = aioredis.from_url(
        tls_infra.redis_url,
        socket_connect_timeout=3,
        **redis_tls_kwargs(tls_infra.redis_url, other),
    )
    try:
        with pytest.raises(RedisConnectionError):
            await client.ping()
    finally:
        await client.aclose()


def test_the_certificates_are_signed_by_their_ca_and_the_keys_private(tmp_path: Path):
    certs = generate(tmp_path / "tls", ["nats", "10.0.0.7"])
    assert oct(certs.server_key.stat().st_mode & 0o777) == "0o600"
    assert oct(Path(certs.client.key_file).stat().st_mode & 0o777) == "0o600"
    ctx = client_context(certs.client)  # loads: the key matches the certificate
    assert ctx.verify_mode is ssl.CERT_REQUIRED
    from cryptography import x509

    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    ca = x509.load_pem_x509_certificate(certs.ca_file.read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "nats" in names.get_values_for_type(x509.DNSName)
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]

"""TLS between the services and NATS and Redis: the certificates, and the client side of it.

``turboserve up`` (and compose's ``certs`` step, ``turboserve certs DIR``) makes a private CA,
one server certificate for NATS and Redis and one client certificate for the services
(:func:`generate`). The servers require TLS and a client certificate signed by that CA (mutual
TLS), so a plain-text client, or one without the certificate, is refused before it can send a
password. Who a client is stays the business of its user and password (shared/security.py):
the certificate proves only that it belongs to the deployment.

Every service reads the three files from ``TURBOSERVE_TLS_CA_FILE``, ``TURBOSERVE_TLS_CERT_FILE``
and ``TURBOSERVE_TLS_KEY_FILE``; :func:`client_context` is its side of the handshake for NATS
(``tls://`` URLs), :func:`redis_tls_kwargs` for Redis (``rediss://`` URLs).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CA_FILE = "ca.crt"
SERVER_CERT, SERVER_KEY = "server.crt", "server.key"
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"
# Names the server certificate is valid for: loopback (``turboserve up``) and the host names
# of compose and the Kubernetes manifests, their clustered brokers included (compose.ha.yaml's
# nodes; deploy/kubernetes/ha/'s StatefulSet pods in the namespace turboserve).
DEFAULT_SERVER_NAMES = (
    "localhost",
    "127.0.0.1",
    "::1",
    "nats",
    "redis",
    *(f"{node}-{i}" for node in ("nats", "redis", "sentinel") for i in (1, 2, 3)),
    *(f"*.{svc}.turboserve.svc" for svc in ("nats", "redis", "sentinel")),
)
VALID_DAYS = 365


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The three files a client needs: the CA it trusts, its certificate and key."""

    ca_file: str
    cert_file: str
    key_file: str

    def env(self) -> dict[str, str]:
        return {
            "TURBOSERVE_TLS_CA_FILE": self.ca_file,
            "TURBOSERVE_TLS_CERT_FILE": self.cert_file,
            "TURBOSERVE_TLS_KEY_FILE": self.key_file,
        }


@dataclass(frozen=True, slots=True)
class Certificates:
    """What :func:`generate` wrote: the servers' files and the clients'."""

    directory: Path
    ca_file: Path
    server_cert: Path
    server_key: Path
    client: TlsFiles


def generate(directory: Path, server_names: Iterable[str] = DEFAULT_SERVER_NAMES) -> Certificates:
    """A new CA, a server certificate for ``server_names`` (host names or IP addresses) and a
    client certificate, written to ``directory`` (keys readable by their owner only). The CA's
    key is not kept: nothing else is ever signed with it."""
    from cryptography import x509  # noqa: PLC0415 - only the tools that make certificates
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)

    def name(common: str) -> x509.Name:
        return x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "TurboServe"),
                x509.NameAttribute(NameOID.COMMON_NAME, common),
            ]
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("TurboServe deployment CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common: str, usage: list[x509.ObjectIdentifier], sans: list[x509.GeneralName]) -> Any:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    sans: list[x509.GeneralName] = []
    for host in server_names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    # The server's certificate also authenticates it as a client: a NATS node dials the others
    # of its cluster (a route) with it.
    server, server_key = leaf(
        "TurboServe NATS and Redis",
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        sans,
    )
    client, client_key = leaf("TurboServe service", [ExtendedKeyUsageOID.CLIENT_AUTH], [])

    def write(filename: str, data: bytes, private: bool = False) -> Path:
        path = directory / filename
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def pem_key(key: Any) -> bytes:
        data: bytes = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return data

    pem = serialization.Encoding.PEM
    ca_path = write(CA_FILE, ca.public_bytes(pem))
    server_cert = write(SERVER_CERT, server.public_bytes(pem))
    server_key_path = write(SERVER_KEY, pem_key(server_key), private=True)
    client_cert = write(CLIENT_CERT, client.public_bytes(pem))
    client_key_path = write(CLIENT_KEY, pem_key(client_key), private=True)
    return Certificates(
        directory=directory,
        ca_file=ca_path,
        server_cert=server_cert,
        server_key=server_key_path,
        client=TlsFiles(str(ca_path), str(client_cert), str(client_key_path)),
    )


def client_context(files: TlsFiles | None) -> ssl.SSLContext:
    """The client side of the handshake: trust the deployment's CA (or the system's, without
    one) and present the client certificate."""
    if files is None or not files.ca_file:
        return ssl.create_default_context()
    ctx = ssl.create_default_context(cafile=files.ca_file)
    if files.cert_file:
        ctx.load_cert_chain(files.cert_file, files.key_file or None)
    return ctx


def server_context(cert: Path, key: Path, ca_file: Path) -> ssl.SSLContext:
    """A server that requires a client certificate signed by ``ca_file``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca_file))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def redis_tls_kwargs(url: str, files: TlsFiles | None) -> dict[str, Any]:
    """What redis-py needs for a ``rediss://`` URL: the CA and the client certificate."""
    if not url.startswith("rediss://") or files is None or not files.ca_file:
        return {}
    kwargs: dict[str, Any] = {"ssl_ca_certs": files.ca_file}
    if files.cert_file:
        kwargs |= {"ssl_certfile": files.cert_file, "ssl_keyfile": files.key_file or None}
    return kwargs


def nats_tls_kwargs(url: str, files: TlsFiles | None) -> dict[str, Any]:
    """What nats-py needs for a ``tls://`` URL (a plain ``nats://`` one needs nothing)."""
    if not url.startswith("tls://") or files is None:
        return {}
    return {"tls": client_context(files)}


def nats_tls_config(cert: Path, key: Path, ca_file: Path) -> str:
    """The ``tls`` block of a nats-server config: TLS required of every client, and a client
    certificate signed by the deployment's CA (``verify``)."""
    return (
        "tls {\n"
        f'  cert_file: "{cert}"\n'
        f'  key_file: "{key}"\n'
        f'  ca_file: "{ca_file}"\n'
        "  verify: true\n"
        "  timeout: 2\n"
        "}\n"
    )


def tls_from_env(env: Mapping[str, str] | None = None) -> TlsFiles | None:
    """The TLS client files of ``TURBOSERVE_TLS_*`` (for tools that connect with a bare URL)."""
    env = os.environ if env is None else env
    ca, cert = env.get("TURBOSERVE_TLS_CA_FILE", ""), env.get("TURBOSERVE_TLS_CERT_FILE", "")
    if not (ca or cert):
        return None
    return TlsFiles(ca, cert, env.get("TURBOSERVE_TLS_KEY_FILE", ""))

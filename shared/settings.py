"""Settings frozen at start: one ``Settings.from_env()`` per service.

Every variable is ``TURBOSERVE_<FIELD>`` (upper case). Values are parsed and validated once;
all faults are reported together in one :class:`SettingsError`. ``str()`` of a settings object
masks secrets (passwords in URLs, tokens), so printing it at start is safe.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Self, get_type_hints
from urllib.parse import unquote

import orjson

from shared.callout import CalloutError, IssuerKey
from shared.policies import LIVE_POLICIES
from shared.tls import TlsFiles
from shared.wire import Subjects, valid_id

ENV_PREFIX = "TURBOSERVE_"
# NATS and Redis on this host: where every service and tool looks when no URL is set.
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "json", "console")
# A chunk's bitrate: below 100 kbit/s a 480p chunk is mush even at libx264's coarsest steps;
# above 50 Mbit/s a chunk of a long period no longer fits the largest NATS payload (64 MiB).
MIN_VIDEO_BITRATE = 100_000
MAX_VIDEO_BITRATE = 50_000_000
DEFAULT_VIDEO_BITRATE = 2_000_000  # 480p streaming: a 0.75 s chunk is at most 187 KiB
# The most workers at once, the one default of TURBOSERVE_MAX_WORKERS for the provisioner, the
# scheduler (until the provisioner writes its limits) and ``turboserve up``.
DEFAULT_MAX_WORKERS = 8
DEFAULT_STREAM_SESSIONS = DEFAULT_MAX_WORKERS * 8  # the default pool's largest, at 8 slots each


class SettingsError(ValueError):
    """One or more settings are invalid; lists every fault with its variable."""

    retryable = False

    def __init__(self, faults: list[str]) -> None:
        super().__init__("invalid settings: " + "; ".join(faults))
        self.faults = faults


def nats_servers(url: str) -> list[str]:
    """The servers of a ``TURBOSERVE_NATS_URL``: one URL, or a comma-separated list of the
    nodes of a cluster (``nats://a:4222,nats://b:4222``); a client connects to any of them and
    reconnects to whichever is up."""
    return [part.strip() for part in url.split(",") if part.strip()]


SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """A Redis found through Sentinel: ``redis+sentinel://[user:password@]host:port,host:port/
    <master>/<db>`` (``rediss+sentinel://``: TLS to the sentinels and to Redis, with the
    deployment's TLS files). The credentials are Redis's; the sentinels are asked without."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int
    username: str | None
    password: str | None
    tls: bool


def parse_sentinel_url(url: str) -> SentinelTarget | None:
    """The Sentinel form of ``TURBOSERVE_REDIS_URL``; None for any other URL. Raises
    ValueError for a Sentinel URL that is not well formed."""
    scheme = next((s for s in SENTINEL_SCHEMES if url.startswith(s)), None)
    if scheme is None:
        return None
    rest = url[len(scheme) :]
    authority, _, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (user or None), (unquote(secret) if colon else None)
    sentinels = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"sentinel {part.strip()!r}: host:port")
        sentinels.append((host, int(port)))
    master, _, db = path.partition("/")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", master):
        raise ValueError("the master's name: 1-64 of [A-Za-z0-9_.-] after the sentinels")
    if db and not db.isdigit():
        raise ValueError(f"the database {db!r}: a number")
    return SentinelTarget(
        tuple(sentinels), master, int(db or 0), username, password, scheme.startswith("rediss")
    )


def mask_url(url: str) -> str:
    """Hide the credentials of a URL: ``redis://u:secret@h`` -> ``redis://u:***@h``,
    ``nats://token@h`` -> ``nats://***@h`` (a password may itself contain ``@``); each URL of
    a comma-separated list."""
    if "," in url and "://" in url:
        return ",".join(mask_url(part) for part in nats_servers(url))
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    masked = f"{user}:***" if colon else "***"
    return f"{scheme}://{masked}@{host}{slash}{path}"


@dataclass(frozen=True, slots=True)
class CommonSettings:
    """What every service needs: where NATS and Redis are, subjects, logging."""

    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset()
    URL_FIELDS: ClassVar[frozenset[str]] = frozenset({"nats_url", "redis_url"})

    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL
    subject_prefix: str = "ts"
    # Redis key namespace; lets several deployments (or test runs) share one Redis.
    redis_namespace: str = "ts"
    log_level: str = "info"
    log_format: str = "auto"
    connect_timeout_s: float = 30.0
    # Grace period for in-flight work on SIGTERM before the service exits anyway.
    shutdown_grace_s: float = 10.0
    # The ops endpoint (/healthz, /metrics): 0 = a free port on loopback, logged (local runs);
    # N = port N on every interface (deployments: probes and scrapers); -1 = off.
    metrics_port: int = 0
    # The H.264 bitrate of a chunk (bits/s; libx264's maxrate, with a VBV buffer): it bounds a
    # chunk's bytes on NATS, and with stream_sessions the chunk stream's retention in bytes
    # (every service declares the streams, so every service reads both).
    video_bitrate: int = DEFAULT_VIDEO_BITRATE
    # Sessions the chunk stream keeps the resume window of (its max_bytes): the pool's
    # largest size times the sessions a worker holds (default: 8 workers x 8 slots).
    stream_sessions: int = DEFAULT_STREAM_SESSIONS
    # TLS to NATS (a tls:// URL) and Redis (a rediss:// URL): the CA the client trusts and the
    # client certificate it presents (shared/tls.py). Empty: the system's CAs, no certificate.
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Replicas of each JetStream stream: 1 on one NATS server, 3 (or 5) on a JetStream cluster,
    # so that a stream outlives the death of the node that leads it.
    stream_replicas: int = 1
    # Redis with replicas (Sentinel): a session's creation and its transitions wait until this
    # many replicas have them, for at most redis_wait_ms (shared/registry.py); 0: no wait.
    redis_wait_replicas: int = 0
    redis_wait_ms: int = 500

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        env = os.environ if env is None else env
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        faults: list[str] = []
        for f in fields(cls):
            var = ENV_PREFIX + f.name.upper()
            if f.name in overrides:
                values[f.name] = overrides[f.name]
                continue
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = _parse(raw, hints[f.name])
            except ValueError as exc:
                faults.append(f"{var}={raw!r}: {exc}")
        if faults:
            raise SettingsError(faults)
        settings = cls(**values)
        settings.validate()
        return settings

    @classmethod
    def given(cls, env: Mapping[str, str] | None = None) -> frozenset[str]:
        """The fields the environment sets (a non-empty ``TURBOSERVE_<FIELD>``): tells a value
        given from its default (``ctl`` looks elsewhere for a URL nobody gave)."""
        env = os.environ if env is None else env
        return frozenset(f.name for f in fields(cls) if env.get(ENV_PREFIX + f.name.upper()))

    def validate(self) -> None:
        faults = self._faults()
        if faults:
            raise SettingsError(faults)

    def _faults(self) -> list[str]:
        faults = []
        servers = nats_servers(self.nats_url)
        if not servers or not all(
            s.startswith(("nats://", "tls://", "ws://", "wss://")) for s in servers
        ):
            faults.append(
                f"TURBOSERVE_NATS_URL={mask_url(self.nats_url)!r}: must be a nats:// URL, or a "
                "comma-separated list of them"
            )
        elif len({s.partition("://")[0] for s in servers}) > 1:
            faults.append(
                f"TURBOSERVE_NATS_URL={mask_url(self.nats_url)!r}: one scheme for every server "
                "(all tls:// or none)"
            )
        if not 1 <= self.stream_replicas <= 5:
            faults.append("TURBOSERVE_STREAM_REPLICAS: 1-5 (JetStream's limit)")
        if self.redis_wait_replicas < 0:
            faults.append("TURBOSERVE_REDIS_WAIT_REPLICAS: must be >= 0")
        if not 1 <= self.redis_wait_ms <= 60_000:
            faults.append("TURBOSERVE_REDIS_WAIT_MS: 1-60000")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://", *SENTINEL_SCHEMES)):
            faults.append(
                f"TURBOSERVE_REDIS_URL={mask_url(self.redis_url)!r}: must be a redis:// URL "
                "(or redis+sentinel://host:port,host:port/<master>/<db>)"
            )
        else:
            try:
                parse_sentinel_url(self.redis_url)
            except ValueError as exc:
                faults.append(f"TURBOSERVE_REDIS_URL={mask_url(self.redis_url)!r}: {exc}")
        try:
            Subjects(self.subject_prefix)
        except ValueError as exc:
            faults.append(f"TURBOSERVE_SUBJECT_PREFIX: {exc}")
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", self.redis_namespace):
            faults.append("TURBOSERVE_REDIS_NAMESPACE: 1-64 characters of [A-Za-z0-9_.:-]")
        if self.log_level not in _LOG_LEVELS:
            faults.append(
                f"TURBOSERVE_LOG_LEVEL={self.log_level!r}: one of {', '.join(_LOG_LEVELS)}"
            )
        if self.log_format not in _LOG_FORMATS:
            faults.append(
                f"TURBOSERVE_LOG_FORMAT={self.log_format!r}: one of {', '.join(_LOG_FORMATS)}"
            )
        for name in ("connect_timeout_s", "shutdown_grace_s"):
            if not 0 < getattr(self, name) < math.inf:
                faults.append(f"TURBOSERVE_{name.upper()}: must be a finite number > 0")
        if not MIN_VIDEO_BITRATE <= self.video_bitrate <= MAX_VIDEO_BITRATE:
            faults.append(
                f"TURBOSERVE_VIDEO_BITRATE={self.video_bitrate}: bits per second, "
                f"{MIN_VIDEO_BITRATE}-{MAX_VIDEO_BITRATE}"
            )
        if self.stream_sessions < 1:
            faults.append("TURBOSERVE_STREAM_SESSIONS: must be >= 1")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            faults.append("TURBOSERVE_TLS_CERT_FILE and TURBOSERVE_TLS_KEY_FILE: both or neither")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                faults.append(f"TURBOSERVE_{name.upper()}={path!r}: no such file")
        if not -1 <= self.metrics_port <= 65535:
            faults.append(
                f"TURBOSERVE_METRICS_PORT={self.metrics_port}: -1 (off), 0 (a free port) or 1-65535"
            )
        return faults

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)

    @property
    def tls(self) -> TlsFiles | None:
        """The TLS client files, or None when none is set."""
        if not (self.tls_ca_file or self.tls_cert_file):
            return None
        return TlsFiles(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)

    def replace(self, **changes: Any) -> Self:
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    def public_dict(self) -> dict[str, Any]:
        """The settings with secrets masked: safe to log."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self.SECRET_FIELDS and value:
                value = "***"
            elif f.name in self.URL_FIELDS:
                value = mask_url(value)
            out[f.name] = value
        return out

    def __str__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.public_dict().items())
        return f"{type(self).__name__}({body})"

    __repr__ = __str__


def _parse(raw: str, type_: Any) -> Any:
    origin = getattr(type_, "__args__", None)
    if origin and type(None) in origin:  # Optional[X]
        if raw.lower() in ("none", "null"):
            return None
        type_ = next(t for t in origin if t is not type(None))
    if type_ is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected a boolean (true/false)")
    if type_ is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError("expected an integer") from None
    if type_ is float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("expected a number") from None
        if not math.isfinite(value):
            raise ValueError("expected a finite number")
        return value
    return raw


_KEY_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def parse_api_keys(text: str, source: str, sep: str = ",") -> tuple[dict[str, str], list[str]]:
    """Parse ``name:key`` entries separated by ``sep`` (blank entries and ``#`` comments are
    skipped); returns the keys by name and the faults, each naming ``source``."""
    keys: dict[str, str] = {}
    faults: list[str] = []
    for n, raw in enumerate(text.split(sep), start=1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        name, colon, key = (part.strip() for part in entry.partition(":"))
        where = f"{source} entry {n}"
        if not colon or not key:
            faults.append(f"{where}: expected name:key")
        elif not _KEY_NAME_RE.fullmatch(name):
            faults.append(f"{where}: key name {name!r} must be 1-64 of [A-Za-z0-9_.-]")
        elif any(c.isspace() for c in key):
            faults.append(f"{where} ({name}): a key must not contain whitespace")
        elif name in keys:
            faults.append(f"{where}: key name {name!r} given twice")
        else:
            keys[name] = key
    return keys, faults


@dataclass(frozen=True, slots=True, repr=False)
class GatewaySettings(CommonSettings):
    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset({"api_token", "api_keys", "operator_key"})

    host: str = "127.0.0.1"
    port: int = 8080
    # Public base URL used in ``stream_url`` and ``ws_url``; empty means relative URLs.
    public_url: str = ""
    max_prompt_chars: int = 2000
    max_body_bytes: int = 64 * 1024
    # API keys that may create sessions: ``name:key`` pairs, comma-separated, and/or a file
    # with one ``name:key`` per line. The single legacy token is the key named "default".
    # With no key at all, anyone may create sessions (a warning says so at start).
    api_keys: str = ""
    api_keys_file: str | None = None
    api_token: str = ""
    # The key for /v1/cluster, the dashboard and operator access to any session; empty: none.
    operator_key: str = ""
    sse_keepalive_s: float = 15.0
    # Lifetimes: a session with no stream or socket attached for idle_after_s goes idle (its
    # state is suspended to host memory); one left unattached for close_after_s more is closed.
    idle_after_s: float = 60.0
    close_after_s: float = 600.0
    # An attachment stays visible to every gateway this long without its refresh.
    attach_ttl_s: float = 15.0
    reap_interval_s: float = 1.0
    # Per API key: sessions open at once, and requests per second (with a burst allowance).
    max_sessions_per_key: int = 32
    rate_per_key_s: float = 20.0
    rate_burst: int = 40
    # Retry-After (seconds) when the pool is at its maximum and every worker is full.
    admission_retry_after_s: int = 10
    # How long prompt/pause/resume wait for the worker's notice before answering 202.
    control_wait_s: float = 5.0
    # Chunks a client may fall behind the live edge before it skips ahead (event: lag).
    client_queue_chunks: int = 16
    # /readyz says ready only once a worker can take a session; true for a pool that starts
    # at zero workers (the first session then waits for one to boot).
    ready_without_workers: bool = False
    # The JPEG frames of ``?format=jpeg`` viewers, made here from the chunk's H.264 (once per
    # chunk for all of a session's JPEG viewers on this gateway, only while it has one).
    jpeg_quality: int = 80
    # Video sessions' input: the largest frame (an encoded image) a client may send, the
    # frames a session's relay holds before it drops the oldest, and the most frames a second
    # taken from a WebRTC camera (the model takes about 16; a camera sends 30).
    max_frame_bytes: int = 1 << 20
    input_buffer_frames: int = 4
    camera_max_fps: float = 16.0

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if not 0 <= self.port <= 65535:
            faults.append(f"TURBOSERVE_PORT={self.port}: must be 0-65535")
        if self.max_prompt_chars < 1:
            faults.append("TURBOSERVE_MAX_PROMPT_CHARS: must be >= 1")
        if self.max_body_bytes < 256:
            faults.append("TURBOSERVE_MAX_BODY_BYTES: must be >= 256")
        for name in (
            "sse_keepalive_s",
            "idle_after_s",
            "close_after_s",
            "attach_ttl_s",
            "reap_interval_s",
            "rate_per_key_s",
            "control_wait_s",
            "camera_max_fps",
        ):
            if not 0 < getattr(self, name) < math.inf:
                faults.append(f"TURBOSERVE_{name.upper()}: must be a finite number > 0")
        for name in (
            "max_sessions_per_key",
            "rate_burst",
            "admission_retry_after_s",
            "client_queue_chunks",
            "max_frame_bytes",
            "input_buffer_frames",
        ):
            if getattr(self, name) < 1:
                faults.append(f"TURBOSERVE_{name.upper()}: must be >= 1")
        if not 1 <= self.jpeg_quality <= 95:
            faults.append("TURBOSERVE_JPEG_QUALITY: must be 1-95")
        if any(c.isspace() for c in self.operator_key):
            faults.append("TURBOSERVE_OPERATOR_KEY: must not contain whitespace")
        faults += self._key_faults()
        return faults

    def _key_faults(self) -> list[str]:
        try:
            self.api_key_map()
        except SettingsError as exc:
            return exc.faults
        return []

    def api_key_map(self) -> dict[str, str]:
        """Every API key by name, from ``api_keys``, ``api_keys_file`` and ``api_token``
        (named "default"); :class:`SettingsError` names each malformed entry."""
        keys, faults = parse_api_keys(self.api_keys, "TURBOSERVE_API_KEYS")
        if self.api_keys_file:
            try:
                with open(self.api_keys_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                faults.append(f"TURBOSERVE_API_KEYS_FILE={self.api_keys_file!r}: {exc.strerror}")
            else:
                source = f"TURBOSERVE_API_KEYS_FILE {self.api_keys_file!r}"
                from_file, file_faults = parse_api_keys(text, source, sep="\n")
                faults += file_faults
                for name in sorted(from_file.keys() & keys.keys()):
                    faults.append(f"{source}: key name {name!r} also in TURBOSERVE_API_KEYS")
                keys.update(from_file)
        if self.api_token:
            if "default" in keys:
                faults.append("TURBOSERVE_API_TOKEN: a key named 'default' is also configured")
            elif any(c.isspace() for c in self.api_token):
                faults.append("TURBOSERVE_API_TOKEN: must not contain whitespace")
            else:
                keys["default"] = self.api_token
        if faults:
            raise SettingsError(faults)
        return keys


@dataclass(frozen=True, slots=True, repr=False)
class SchedulerSettings(CommonSettings):
    # How often the loop re-evaluates (scale-in, dead workers, lost events).
    tick_s: float = 0.5
    # A worker whose heartbeat is older than this is considered gone.
    worker_timeout_s: float = 5.0
    # A worker declared lost is shown as `lost` (no sessions) this long, then drops from view.
    lost_worker_shown_s: float = 30.0
    # The policy by name (turboserve, no_migration, least_loaded, ...; see docs/scheduler.md).
    policy: str = "turboserve"
    # The latency profile of the default GPU kind: a shipped name or a JSON path (empty: the
    # shipped default); the kinds the workers report are then measured live.
    profile: str = ""
    # The adaptive rho_hat table: a JSON path, empty for the shipped one, "none" for a fixed
    # rho_hat.
    rho_table: str = ""
    # Pool limits when the provisioner has not written its own (it normally has).
    min_workers: int = 1
    max_workers: int = DEFAULT_MAX_WORKERS
    # After a scale event, no scale event the other way for this long (s): no drain right
    # after a GPU was asked for, no GPU asked for right after a drain unless sessions wait.
    scale_cooldown_s: float = 30.0
    # Experiments: the delay the provisioner puts before a worker starts (the same setting).
    boot_delay_s: float = 0.0
    # A requested GPU not ready this long after the request is given up (the same setting).
    boot_timeout_s: float = 300.0
    # Active/standby: the leader lease's time to live (a standby takes over within it).
    leader_ttl_s: float = 3.0
    scheduler_id: str = dataclasses.field(default_factory=lambda: _default_worker_id())
    # How long a worker has to answer a command before it is sent again.
    command_timeout_s: float = 2.0
    # How long one migration may take (the workers' setting of the same name).
    handoff_timeout_s: float = 30.0
    # Names of the GPUs it asks for: <prefix>-NNNN (empty: the GPU kind in lower case).
    gpu_id_prefix: str = ""
    # How often (s, default 5) the latency model of each GPU kind is recomputed from the
    # workers' heartbeats (a worker joining recomputes it at once).
    profile_refresh_s: float = 5.0
    # Every this many ticks (default 4) the core's view is repaired from the registry
    # (sessions it never heard of, sessions placed elsewhere than it thinks).
    reconcile_ticks: int = 4
    # The quality budget's floor (the workers' setting of the same name): the fewest
    # denoising steps per chunk the policy may ask a GPU for; none = the full count (off).
    min_steps: int | None = None
    # The policy's own parameters, a JSON object of its loose parameters (docs/scheduler.md),
    # e.g. {"confidence": 0.95} for turboserve_staffing; empty: the policy's defaults.
    policy_params: str = ""

    @property
    def policy_param_values(self) -> dict[str, Any]:
        """``policy_params`` as a dict (checked at start: a JSON object)."""
        return dict(orjson.loads(self.policy_params)) if self.policy_params.strip() else {}

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if self.policy_params.strip():
            try:
                value = orjson.loads(self.policy_params)
            except orjson.JSONDecodeError as exc:
                value = exc
            if not isinstance(value, dict):
                faults.append(
                    f"TURBOSERVE_POLICY_PARAMS={self.policy_params!r}: a JSON object of the "
                    'policy\'s parameters, e.g. {"confidence": 0.95}'
                )
        for name in (
            "tick_s",
            "worker_timeout_s",
            "leader_ttl_s",
            "command_timeout_s",
            "handoff_timeout_s",
            "boot_timeout_s",
            "lost_worker_shown_s",
            "profile_refresh_s",
        ):
            if not 0 < getattr(self, name) < math.inf:
                faults.append(f"TURBOSERVE_{name.upper()}: must be a finite number > 0")
        if self.reconcile_ticks < 1:
            faults.append("TURBOSERVE_RECONCILE_TICKS: must be >= 1")
        faults.extend(_min_steps_faults(self.min_steps))
        if not 0 <= self.boot_delay_s < math.inf:
            faults.append("TURBOSERVE_BOOT_DELAY_S: must be a finite number >= 0")
        if not 0 <= self.scale_cooldown_s < math.inf:
            faults.append("TURBOSERVE_SCALE_COOLDOWN_S: must be a finite number >= 0")
        if self.min_workers < 0:
            faults.append("TURBOSERVE_MIN_WORKERS: must be >= 0")
        if self.max_workers < max(1, self.min_workers):
            faults.append("TURBOSERVE_MAX_WORKERS: must be >= max(1, TURBOSERVE_MIN_WORKERS)")
        if not valid_id(self.scheduler_id):
            faults.append(f"TURBOSERVE_SCHEDULER_ID={self.scheduler_id!r}: 1-128 of [A-Za-z0-9_-]")
        if self.gpu_id_prefix and not re.fullmatch(
            r"[A-Za-z0-9][A-Za-z0-9_-]{0,40}", self.gpu_id_prefix
        ):
            faults.append(
                f"TURBOSERVE_GPU_ID_PREFIX={self.gpu_id_prefix!r}: letters, digits, '-' or '_'"
            )
        if self.policy not in LIVE_POLICIES:
            faults.append(
                f"TURBOSERVE_POLICY={self.policy!r}: not a policy the live scheduler "
                f"runs; one of {', '.join(LIVE_POLICIES)} (one that needs the future, "
                "as the evaluation's clairvoyant, runs only in the simulator)"
            )
        return faults


def _min_steps_faults(min_steps: int | None) -> list[str]:
    """TURBOSERVE_MIN_STEPS below 1 (the full count, its upper bound, is the model's: the
    worker checks it once the model is loaded)."""
    if min_steps is not None and min_steps < 1:
        return [f"TURBOSERVE_MIN_STEPS={min_steps}: must be >= 1 (denoising steps per chunk)"]
    return []


DEFAULT_SLOTS = 8
DEFAULT_CHUNK_PERIOD_S = 0.75  # 12 frames at 16 fps


def _default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


@dataclass(frozen=True, slots=True, repr=False)
class WorkerSettings(CommonSettings):
    worker_id: str = dataclasses.field(default_factory=_default_worker_id)
    preset: str = "tiny"
    # "auto" = first CUDA device when there is one, else the CPU.
    device: str = "auto"
    # Session slots; none = as many as fit in free memory (at most 8), or the emulated
    # profile's capacity K. A number that does not fit is refused at start.
    max_sessions: int | None = None
    # The chunks one pass may decode (the VAE's peak memory is per chunk; the others decode at
    # the next pass); none = every chunk that completes.
    max_decodes_per_pass: int | None = None
    # The causal DiT (Self-Forcing / LongLive .pt, safetensors); none: the folder's, or the
    # seeded stand-in.
    checkpoint: str | None = None
    # A Wan2.1 text-to-video model folder (diffusers or original layout): umT5 and the Wan VAE
    # (and the DiT, unless TURBOSERVE_CHECKPOINT names it). None: the stand-ins.
    model: str | None = None
    # The video size HxW of a loaded model (none: 480x832, Wan2.1's; the preset's without one).
    resolution: str | None = None
    # Where umT5 runs ("cuda:1", "cpu"; none: the worker's device).
    text_device: str | None = None
    # On a prompt change: kv (LongLive's KV re-cache), cross (swap the cross-attention only),
    # auto (kv for LongLive checkpoints and the stand-in, cross for other checkpoints).
    prompt_recache: str = "auto"
    seed: int = 0
    heartbeat_s: float = 1.0
    # Playback pace: a chunk is due this long after the previous one (0 = as fast as possible);
    # none = 0.75 s (12 frames at 16 fps), or the emulated profile's deadline.
    chunk_period_s: float | None = None
    # How far ahead of its due time a chunk may be done (the viewer's buffer); none = one period.
    pace_lead_s: float | None = None
    # Threads that encode chunks (H.264) off the generation thread; none: one per session
    # slot, at most the host's CPU count.
    encode_threads: int | None = None
    gpu_kind: str = "cpu"
    # After every chunk, log what rebuilds the session (its latents in the attention window,
    # prompt, seed, seq) in Redis, so that it continues exactly on another worker if this one
    # is lost; off: such a session restarts from its prompt (and its viewers are told).
    recovery_log: bool = True
    # Emulate a GPU kind of a latency profile: run the real model, but pace every pass to the
    # profile's time for its batch (CPU hosts that stand in for GPUs in experiments).
    emulate: str = ""
    emulate_profile: str | None = None  # a profile JSON; none = the scheduler's default profile
    # Session-state handoff (migration): the address peers reach this worker at ("auto": the
    # address this host's name resolves to, as in a container), its port
    # (0 = any free one), the transport (auto: NCCL between CUDA devices, CUDA IPC on one
    # device, gloo on the CPU) and how long one handoff may take before it is aborted.
    handoff_host: str = "127.0.0.1"
    handoff_port: int = 0
    handoff_transport: str = "auto"
    handoff_timeout_s: float = 30.0
    # The quality budget's floor: the fewest denoising steps a chunk may run when the
    # scheduler asks this worker for fewer than the model's full count (a STEPS command);
    # none = the full count (the budget off). Above the full count: refused once the model is
    # loaded (the count is the model's).
    min_steps: int | None = None
    # A worker the provisioner did not start (compose's fixed pool): TURBOSERVE_NATS_URL is the
    # enrol user's, used once to ask the provisioner for this worker's own NATS user
    # (shared/enrol.py); the worker then connects as that.
    enrol: bool = False

    def handoff_address(self) -> str:
        """Where peers reach this worker's handoff rendezvous (``auto`` resolved here)."""
        if self.handoff_host != "auto":
            return self.handoff_host
        return socket.gethostbyname(socket.gethostname())

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if not valid_id(self.worker_id):
            faults.append(f"TURBOSERVE_WORKER_ID={self.worker_id!r}: 1-128 of [A-Za-z0-9_-]")
        if self.max_sessions is not None and self.max_sessions < 1:
            faults.append("TURBOSERVE_MAX_SESSIONS: must be >= 1")
        if self.max_decodes_per_pass is not None and self.max_decodes_per_pass < 1:
            faults.append("TURBOSERVE_MAX_DECODES_PER_PASS: must be >= 1")
        if self.heartbeat_s <= 0:
            faults.append("TURBOSERVE_HEARTBEAT_S: must be > 0")
        if self.chunk_period_s is not None and not 0 <= self.chunk_period_s < math.inf:
            faults.append("TURBOSERVE_CHUNK_PERIOD_S: must be a finite number >= 0")
        if self.resolution is not None and parse_resolution(self.resolution) is None:
            faults.append(
                f"TURBOSERVE_RESOLUTION={self.resolution!r}: HEIGHTxWIDTH, multiples "
                "of 16 (e.g. 480x832)"
            )
        if self.prompt_recache not in ("auto", "kv", "cross"):
            faults.append(
                f"TURBOSERVE_PROMPT_RECACHE={self.prompt_recache!r}: one of auto, kv, cross"
            )
        if self.encode_threads is not None and self.encode_threads < 1:
            faults.append("TURBOSERVE_ENCODE_THREADS: must be >= 1")
        if self.pace_lead_s is not None and not 0 <= self.pace_lead_s < math.inf:
            faults.append("TURBOSERVE_PACE_LEAD_S: must be a finite number >= 0")
        if not 0 <= self.handoff_port <= 65535:
            faults.append(f"TURBOSERVE_HANDOFF_PORT={self.handoff_port}: must be 0-65535")
        if self.handoff_transport not in ("auto", "gloo", "nccl", "cuda_ipc"):
            faults.append(
                f"TURBOSERVE_HANDOFF_TRANSPORT={self.handoff_transport!r}: one of auto, "
                "gloo, nccl, cuda_ipc"
            )
        if not 0 < self.handoff_timeout_s < math.inf:
            faults.append("TURBOSERVE_HANDOFF_TIMEOUT_S: must be a finite number > 0")
        faults.extend(_min_steps_faults(self.min_steps))
        return faults

    @property
    def slots(self) -> int:
        """Session slots when not emulating (the worker resolves the emulated default)."""
        return DEFAULT_SLOTS if self.max_sessions is None else self.max_sessions


def parse_resolution(text: str) -> tuple[int, int] | None:
    """``"480x832"`` to (480, 832); None unless both are positive multiples of 16 (the VAE's
    stride times the DiT's patch)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if match is None:
        return None
    height, width = int(match[1]), int(match[2])
    if height <= 0 or width <= 0 or height % 16 or width % 16:
        return None
    return height, width


@dataclass(frozen=True, slots=True, repr=False)
class ProvisionerSettings(CommonSettings):
    """The pool manager. Workers take their own settings (preset, device, emulate...) from the
    environment: a local worker inherits the provisioner's, a pod gets its template's."""

    URL_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"nats_url", "redis_url", "worker_nats_url", "worker_redis_url"}
    )
    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset({"callout_key"})

    backend: str = "local"  # local | kubernetes
    # The pool never shrinks below min_workers (kept running from the start, replaced when
    # they die) nor grows past max_workers (booting ones count).
    min_workers: int = 1
    max_workers: int = DEFAULT_MAX_WORKERS
    # Experiments: a started worker is launched this long after the request; it counts as
    # booting, and costs, from the request.
    boot_delay_s: float = 0.0
    # A worker not READY this long after its request is stopped and reported gone.
    boot_timeout_s: float = 300.0
    # local: the GPUs to hand out, one worker each: auto (every GPU nvidia-ml-py finds), none
    # (CPU workers), or a comma-separated list of GPU UUIDs or indices.
    gpus: str = "auto"
    # The GPU kind the workers emulate (the workers' own TURBOSERVE_EMULATE, which they
    # inherit; a pod gets it too): shown in events and metrics. Empty: real devices.
    emulate: str = ""
    # kubernetes: the namespace (empty: the provisioner's own, else "default"), the PodTemplate
    # each worker pod is made from, and how often pods are listed to notice deaths.
    k8s_namespace: str = ""
    k8s_pod_template: str = "turboserve-worker"
    k8s_poll_s: float = 2.0
    # local: the NATS and Redis URLs of the workers it starts, with the workers' own
    # credentials (docs/security.md); empty: the provisioner's own URLs.
    worker_nats_url: str = ""
    worker_redis_url: str = ""
    # local: a folder where each worker it starts writes its own log (worker-<id>.log);
    # empty: the workers write where the provisioner does.
    worker_log_dir: str = ""
    # The private key of the NATS auth callout's issuer (shared/callout.py): set, the
    # provisioner answers the server's callout for the workers, and each local worker it
    # starts connects as a user of its own (its id, and a password made for it) instead of
    # TURBOSERVE_WORKER_NATS_URL's user. Empty: no callout.
    callout_key: str = ""

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if self.callout_key:
            try:
                IssuerKey.from_text(self.callout_key)
            except CalloutError as exc:
                faults.append(f"TURBOSERVE_CALLOUT_KEY: {exc}")
        if self.worker_nats_url and not self.worker_nats_url.startswith(
            ("nats://", "tls://", "ws://", "wss://")
        ):
            faults.append(
                f"TURBOSERVE_WORKER_NATS_URL={mask_url(self.worker_nats_url)!r}: "
                "must be a nats:// URL"
            )
        if self.worker_redis_url and not self.worker_redis_url.startswith(
            ("redis://", "rediss://", "unix://", *SENTINEL_SCHEMES)
        ):
            faults.append(
                f"TURBOSERVE_WORKER_REDIS_URL={mask_url(self.worker_redis_url)!r}: "
                "must be a redis:// URL (or the Sentinel form)"
            )
        if self.backend not in ("local", "kubernetes"):
            faults.append(f"TURBOSERVE_BACKEND={self.backend!r}: one of local, kubernetes")
        if self.min_workers < 0:
            faults.append("TURBOSERVE_MIN_WORKERS: must be >= 0")
        if self.max_workers < max(1, self.min_workers):
            faults.append("TURBOSERVE_MAX_WORKERS: must be >= max(1, TURBOSERVE_MIN_WORKERS)")
        if not 0 <= self.boot_delay_s < math.inf:
            faults.append("TURBOSERVE_BOOT_DELAY_S: must be a finite number >= 0")
        for name in ("boot_timeout_s", "k8s_poll_s"):
            if not 0 < getattr(self, name) < math.inf:
                faults.append(f"TURBOSERVE_{name.upper()}: must be a finite number > 0")
        if self.boot_timeout_s <= self.boot_delay_s:
            faults.append(
                "TURBOSERVE_BOOT_TIMEOUT_S: must be longer than TURBOSERVE_BOOT_DELAY_S "
                "(both count from the request)"
            )
        if not re.fullmatch(r"auto|none|[A-Za-z0-9_:-]+(,[A-Za-z0-9_:-]+)*", self.gpus):
            faults.append(
                f"TURBOSERVE_GPUS={self.gpus!r}: auto, none, or a comma-separated "
                "list of GPU UUIDs or indices"
            )
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", self.k8s_pod_template):
            faults.append(
                f"TURBOSERVE_K8S_POD_TEMPLATE={self.k8s_pod_template!r}: a Kubernetes object name"
            )
        if self.k8s_namespace and not re.fullmatch(
            r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.k8s_namespace
        ):
            faults.append(
                f"TURBOSERVE_K8S_NAMESPACE={self.k8s_namespace!r}: a Kubernetes namespace name"
            )
        return faults


@dataclass(frozen=True, slots=True, repr=False)
class ToolSettings(CommonSettings):
    """What the command-line tools read (``up``, ``ctl``, ``replay``, ``chaos``, the benches):
    the mesh's settings, and those of the services ``up`` starts that it reports itself."""

    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"api_key", "api_keys", "api_token", "operator_key"}
    )

    # Where ``turboserve up`` keeps its state file and logs; empty: ~/.turboserve.
    state_dir: str = ""
    # The gateway ``up`` starts: its address and port.
    host: str = "127.0.0.1"
    port: int = 8080
    # The pool ``up`` starts: workers at start and the most the autoscaler may grow it to.
    min_workers: int = 1
    max_workers: int = DEFAULT_MAX_WORKERS
    # The GPU kind CPU workers emulate; none: ``up`` decides (H20 where there is no GPU).
    emulate: str | None = None
    # How long ``up`` waits for its first worker (the provisioner's setting of the same name).
    boot_timeout_s: float = 300.0
    # What the workers ``up`` starts run, which its banner names (the workers' settings of
    # the same names): a Wan2.1 model folder, else the stand-in's preset.
    model: str | None = None
    preset: str = "tiny"
    # The sessions' lifetimes (the gateways' settings of the same names), by which ``up``
    # settles the sessions an earlier run left in a Redis it reuses.
    idle_after_s: float = 60.0
    close_after_s: float = 600.0
    # The key ``replay`` calls the gateway with.
    api_key: str = ""
    # The gateway's keys (see GatewaySettings): ``up`` makes a local one when none is set.
    api_keys: str = ""
    api_keys_file: str | None = None
    api_token: str = ""
    operator_key: str = ""

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if not 0 <= self.port <= 65535:
            faults.append(f"TURBOSERVE_PORT={self.port}: must be 0-65535")
        if self.min_workers < 0:
            faults.append("TURBOSERVE_MIN_WORKERS: must be >= 0")
        if self.max_workers < 1:
            faults.append("TURBOSERVE_MAX_WORKERS: must be >= 1")
        if not 0 < self.boot_timeout_s < math.inf:
            faults.append("TURBOSERVE_BOOT_TIMEOUT_S: must be a finite number > 0")
        return faults

    @property
    def state_path(self) -> Path:
        """The folder of ``up``'s state file: ``state_dir``, else ~/.turboserve."""
        return Path(self.state_dir).expanduser() if self.state_dir else Path.home() / ".turboserve"


@dataclass(frozen=True, slots=True, repr=False)
class SuiteSettings(CommonSettings):
    """What the test suite reads: the NATS and Redis its integration tests use, and how the
    browser tests behave."""

    # Without chromium the browser tests fail (instead of being skipped).
    require_browser: bool = False
    # A folder where the browser tests save their pages as PNGs; empty: none saved.
    screenshot_dir: str = ""

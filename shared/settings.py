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
from typing import Any, ClassVar, Self, get_type_hints

from shared.wire import Subjects, valid_id

ENV_PREFIX = "TURBOSERVE_"
_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "json", "console")


class SettingsError(ValueError):
    """One or more settings are invalid; lists every fault with its variable."""

    retryable = False

    def __init__(self, faults: list[str]) -> None:
        super().__init__("invalid settings: " + "; ".join(faults))
        self.faults = faults


def mask_url(url: str) -> str:
    """Hide the credentials of a URL: ``redis://u:secret@h`` -> ``redis://u:***@h``,
    ``nats://token@h`` -> ``nats://***@h`` (a password may itself contain ``@``)."""
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

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    subject_prefix: str = "ts"
    # Redis key namespace; lets several deployments (or test runs) share one Redis.
    redis_namespace: str = "ts"
    log_level: str = "info"
    log_format: str = "auto"
    connect_timeout_s: float = 30.0
    # Grace period for in-flight work on SIGTERM before the service exits anyway.
    shutdown_grace_s: float = 10.0

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

    def validate(self) -> None:
        faults = self._faults()
        if faults:
            raise SettingsError(faults)

    def _faults(self) -> list[str]:
        faults = []
        if not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            faults.append(f"TURBOSERVE_NATS_URL={mask_url(self.nats_url)!r}: must be a nats:// URL")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            faults.append(f"TURBOSERVE_REDIS_URL={mask_url(self.redis_url)!r}: must be a redis:// URL")
        try:
            Subjects(self.subject_prefix)
        except ValueError as exc:
            faults.append(f"TURBOSERVE_SUBJECT_PREFIX: {exc}")
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", self.redis_namespace):
            faults.append("TURBOSERVE_REDIS_NAMESPACE: 1-64 characters of [A-Za-z0-9_.:-]")
        if self.log_level not in _LOG_LEVELS:
            faults.append(f"TURBOSERVE_LOG_LEVEL={self.log_level!r}: one of {', '.join(_LOG_LEVELS)}")
        if self.log_format not in _LOG_FORMATS:
            faults.append(f"TURBOSERVE_LOG_FORMAT={self.log_format!r}: one of {', '.join(_LOG_FORMATS)}")
        for name in ("connect_timeout_s", "shutdown_grace_s"):
            if not 0 < getattr(self, name) < math.inf:
                faults.append(f"TURBOSERVE_{name.upper()}: must be a finite number > 0")
        return faults

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)

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


@dataclass(frozen=True, slots=True, repr=False)
class GatewaySettings(CommonSettings):
    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset({"api_token"})

    host: str = "127.0.0.1"
    port: int = 8080
    # Public base URL used in ``stream_url``; empty means relative URLs.
    public_url: str = ""
    max_prompt_chars: int = 2000
    max_body_bytes: int = 64 * 1024
    # Bearer token required on /v1 when set (the security wave deepens this).
    api_token: str = ""
    sse_keepalive_s: float = 15.0

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if not 0 <= self.port <= 65535:
            faults.append(f"TURBOSERVE_PORT={self.port}: must be 0-65535")
        if self.max_prompt_chars < 1:
            faults.append("TURBOSERVE_MAX_PROMPT_CHARS: must be >= 1")
        if self.max_body_bytes < 256:
            faults.append("TURBOSERVE_MAX_BODY_BYTES: must be >= 256")
        if self.sse_keepalive_s <= 0:
            faults.append("TURBOSERVE_SSE_KEEPALIVE_S: must be > 0")
        return faults


@dataclass(frozen=True, slots=True, repr=False)
class SchedulerSettings(CommonSettings):
    # How often pending sessions and dead workers are re-examined.
    tick_s: float = 0.5
    # A worker whose heartbeat is older than this is considered gone.
    worker_timeout_s: float = 5.0

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if self.tick_s <= 0:
            faults.append("TURBOSERVE_TICK_S: must be > 0")
        if self.worker_timeout_s <= 0:
            faults.append("TURBOSERVE_WORKER_TIMEOUT_S: must be > 0")
        return faults


def _default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


@dataclass(frozen=True, slots=True, repr=False)
class WorkerSettings(CommonSettings):
    worker_id: str = dataclasses.field(default_factory=_default_worker_id)
    preset: str = "tiny"
    # "auto" = first CUDA device when there is one, else the CPU.
    device: str = "auto"
    max_sessions: int = 8
    checkpoint: str | None = None
    seed: int = 0
    heartbeat_s: float = 1.0
    # Playback pace: a chunk is due this long after the previous one (0 = as fast as possible).
    chunk_period_s: float = 0.75
    # How far ahead of its due time a chunk may be done (the viewer's buffer); none = one period.
    pace_lead_s: float | None = None
    jpeg_quality: int = 80
    gpu_kind: str = "cpu"
    # Emulate a GPU kind of a latency profile: run the real model, but pace every pass to the
    # profile's time for its batch (CPU hosts that stand in for GPUs in experiments).
    emulate: str = ""
    emulate_profile: str | None = None  # a profile JSON; none = the scheduler's default profile
    # Session-state handoff (migration): the address peers reach this worker at, its port
    # (0 = any free one), the transport (auto: NCCL between CUDA devices, CUDA IPC on one
    # device, gloo on the CPU) and how long one handoff may take before it is aborted.
    handoff_host: str = "127.0.0.1"
    handoff_port: int = 0
    handoff_transport: str = "auto"
    handoff_timeout_s: float = 30.0

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if not valid_id(self.worker_id):
            faults.append(f"TURBOSERVE_WORKER_ID={self.worker_id!r}: 1-128 of [A-Za-z0-9_-]")
        if self.max_sessions < 1:
            faults.append("TURBOSERVE_MAX_SESSIONS: must be >= 1")
        if self.heartbeat_s <= 0:
            faults.append("TURBOSERVE_HEARTBEAT_S: must be > 0")
        if self.chunk_period_s < 0:
            faults.append("TURBOSERVE_CHUNK_PERIOD_S: must be >= 0")
        if not 1 <= self.jpeg_quality <= 100:
            faults.append("TURBOSERVE_JPEG_QUALITY: must be 1-100")
        if self.pace_lead_s is not None and not 0 <= self.pace_lead_s < math.inf:
            faults.append("TURBOSERVE_PACE_LEAD_S: must be a finite number >= 0")
        if not 0 <= self.handoff_port <= 65535:
            faults.append(f"TURBOSERVE_HANDOFF_PORT={self.handoff_port}: must be 0-65535")
        if self.handoff_transport not in ("auto", "gloo", "nccl", "cuda_ipc"):
            faults.append(f"TURBOSERVE_HANDOFF_TRANSPORT={self.handoff_transport!r}: one of auto, "
                          "gloo, nccl, cuda_ipc")
        if not 0 < self.handoff_timeout_s < math.inf:
            faults.append("TURBOSERVE_HANDOFF_TIMEOUT_S: must be a finite number > 0")
        return faults

    @property
    def lead_s(self) -> float:
        """The pacing lead in force: the setting, or one chunk period."""
        return self.chunk_period_s if self.pace_lead_s is None else self.pace_lead_s


@dataclass(frozen=True, slots=True, repr=False)
class ProvisionerSettings(CommonSettings):
    backend: str = "local"
    # Workers kept running from the start (the autoscaler asks for more in a later wave).
    min_workers: int = 1
    max_workers: int = 8
    # Extra environment for the workers it starts (preset, device...) is inherited.
    worker_preset: str = "tiny"

    def _faults(self) -> list[str]:
        faults = CommonSettings._faults(self)
        if self.backend not in ("local",):
            faults.append(f"TURBOSERVE_BACKEND={self.backend!r}: one of local")
        if self.min_workers < 0:
            faults.append("TURBOSERVE_MIN_WORKERS: must be >= 0")
        if self.max_workers < max(1, self.min_workers):
            faults.append("TURBOSERVE_MAX_WORKERS: must be >= max(1, TURBOSERVE_MIN_WORKERS)")
        return faults

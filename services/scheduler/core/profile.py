"""Latency model of one GPU kind running one model: a measured (or documented) table.

A profile is a small JSON file (see ``core/profiles/*.json`` and docs/scheduler.md)::

    {
      "name": "h20-longlive-1.3b-nvlink",
      "gpu_kind": "H20", "model": "LongLive-1.3B", "interconnect": "nvlink",
      "chunk_ms": [420.0, 491.0, ...],       # time of one coalesced step at batch 1, 2, ...
      "passes_per_chunk": 5,                 # optional, default 1: model passes per chunk
      "deadline_ms": 1250.0,                 # a chunk must be ready within this
      "state_bytes_per_session": 3550000000, # KV cache + prompt embeddings + RNG + position
      "migration": {"per_session_ms": 26.5, "fixed_ms": 3.0},
      "memory": {"gpu_bytes": ..., "reserved_bytes": ...},  # reserved: weights, workspace
      "price_usd_per_gpu_hour": 2.0,         # optional
      "sources": {"chunk_ms": "where it comes from", ...}   # optional, free text
    }

``turboserve bench worker`` writes the same format from measurements. Capacity ``K`` is not
stored: it is the largest batch that both meets the deadline and fits in memory (and that the
table covers), so a measured table and a memory budget are all that decide it.

``passes_per_chunk`` (default 1 when absent, which is the chunk-level model that measured and
older profiles describe) is the number of batched model passes that make one chunk: a few-step
sampler's denoising passes plus the pass that writes the KV cache (Self-Forcing / LongLive: 4
denoising steps + 1 cache write = 5). An engine with pass-level admission runs the same batch
through every pass, so one pass of ``n`` sessions takes ``pass_ms(n) = chunk_ms(n) /
passes_per_chunk``, and a session that becomes active (or arrives by migration) joins at the
next *pass* boundary instead of the next chunk boundary.

The latency of a GPU is ``chunk_ms(n)`` for its ``n`` active sessions; ``chunk_ms`` must be
non-decreasing in ``n`` (checked on load), which is what lets placement treat "the GPU whose
latency grows least" as "the least loaded GPU".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "h20-longlive-1.3b-nvlink"


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the source and the offending field.

    Retrying cannot help: the file has to be fixed."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"profile {source}: {problem}")
        self.source = source
        self.problem = problem


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    name: str
    gpu_kind: str
    model: str
    chunk_ms_table: tuple[float, ...]
    deadline_ms: float
    state_bytes_per_session: int
    migration_per_session_ms: float
    migration_fixed_ms: float = 0.0
    gpu_memory_bytes: int | None = None
    reserved_memory_bytes: int = 0
    interconnect: str = "unknown"
    price_usd_per_gpu_hour: float | None = None
    passes_per_chunk: int = 1
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    # ---- derived ------------------------------------------------------------------------

    @property
    def deadline_capacity(self) -> int:
        """Largest batch in the table whose chunk time meets the deadline (0 if none)."""
        best = 0
        for batch, ms in enumerate(self.chunk_ms_table, start=1):
            if ms <= self.deadline_ms:
                best = batch
        return best

    @property
    def memory_capacity(self) -> int | None:
        """Sessions whose state fits next to the reserved memory (None: no memory given)."""
        if self.gpu_memory_bytes is None:
            return None
        free = self.gpu_memory_bytes - self.reserved_memory_bytes
        return max(0, free // self.state_bytes_per_session)

    @property
    def capacity(self) -> int:
        """K: sessions one GPU may hold, bounded by deadline, memory and the table's length."""
        k = self.deadline_capacity
        mem = self.memory_capacity
        return k if mem is None else min(k, mem)

    @property
    def capacity_reason(self) -> str:
        mem = self.memory_capacity
        if mem is not None and mem < self.deadline_capacity:
            return "memory"
        return "deadline"

    def chunk_ms(self, batch: int) -> float:
        """Time of one coalesced step with ``batch`` active sessions (0 for an empty GPU).

        Beyond the table the last slope is extended linearly, so an overloaded GPU (which the
        controller never creates, but a static baseline may be asked about) still has a finite,
        growing latency."""
        if batch <= 0:
            return 0.0
        table = self.chunk_ms_table
        if batch <= len(table):
            return table[batch - 1]
        slope = table[-1] - table[-2] if len(table) >= 2 else table[-1]
        return table[-1] + slope * (batch - len(table))

    def pass_ms(self, batch: int) -> float:
        """Time of one batched model pass with ``batch`` sessions: ``chunk_ms(batch) /
        passes_per_chunk``; the longest a joining session waits for a pass boundary."""
        return self.chunk_ms(batch) / self.passes_per_chunk

    def migration_ms(self, state_bytes: int | None = None) -> float:
        """Cost of moving one session's state of ``state_bytes`` (default: a typical session):
        a fixed part (handshake, ownership change) plus a part proportional to the bytes."""
        if state_bytes is None:
            return self.migration_per_session_ms
        variable = self.migration_per_session_ms - self.migration_fixed_ms
        return self.migration_fixed_ms + variable * state_bytes / self.state_bytes_per_session

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "gpu_kind": self.gpu_kind,
            "model": self.model,
            "interconnect": self.interconnect,
            "chunk_ms": list(self.chunk_ms_table),
            "deadline_ms": self.deadline_ms,
            "state_bytes_per_session": self.state_bytes_per_session,
            "migration": {
                "per_session_ms": self.migration_per_session_ms,
                "fixed_ms": self.migration_fixed_ms,
            },
        }
        if self.passes_per_chunk != 1:
            out["passes_per_chunk"] = self.passes_per_chunk
        if self.gpu_memory_bytes is not None:
            out["memory"] = {
                "gpu_bytes": self.gpu_memory_bytes,
                "reserved_bytes": self.reserved_memory_bytes,
            }
        if self.price_usd_per_gpu_hour is not None:
            out["price_usd_per_gpu_hour"] = self.price_usd_per_gpu_hour
        if self.sources:
            out["sources"] = dict(self.sources)
        return out


# ---- loading and validation -----------------------------------------------------------------

def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> LatencyProfile:
    """Load a shipped profile by name (``core/profiles/<name>.json``) or any JSON file by path.

    Raises :class:`ProfileError` naming the file and the field for anything malformed."""
    path = _resolve(name_or_path)
    source = str(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(source, f"not valid JSON ({exc})") from exc
    return profile_from_dict(raw, source=source)


def save_profile(profile: LatencyProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")


def _resolve(name_or_path: str | Path) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix == ".json" or candidate.exists():
        if not candidate.is_file():
            raise ProfileError(str(candidate), "no such file")
        return candidate
    shipped = PROFILE_DIR / f"{name_or_path}.json"
    if not shipped.is_file():
        known = ", ".join(available_profiles()) or "none"
        raise ProfileError(str(name_or_path), f"no such profile (shipped: {known})")
    return shipped


def profile_from_dict(raw: Any, source: str = "<dict>") -> LatencyProfile:
    if not isinstance(raw, dict):
        raise ProfileError(source, "top level must be a JSON object")
    get = _Fields(raw, source)
    chunk = get.list_of_positive("chunk_ms")
    for batch in range(1, len(chunk)):
        if chunk[batch] < chunk[batch - 1]:
            raise ProfileError(
                source,
                f"chunk_ms must be non-decreasing in batch size, but batch {batch + 1} "
                f"({chunk[batch]} ms) is faster than batch {batch} ({chunk[batch - 1]} ms)",
            )
    migration = get.obj("migration")
    mig = _Fields(migration, source, prefix="migration.")
    memory = get.obj("memory", required=False)
    mem = _Fields(memory, source, prefix="memory.") if memory is not None else None
    state_bytes = int(get.positive("state_bytes_per_session"))
    profile = LatencyProfile(
        name=get.text("name"),
        gpu_kind=get.text("gpu_kind"),
        model=get.text("model"),
        interconnect=get.text("interconnect", required=False) or "unknown",
        chunk_ms_table=tuple(chunk),
        deadline_ms=get.positive("deadline_ms"),
        state_bytes_per_session=state_bytes,
        migration_per_session_ms=mig.non_negative("per_session_ms"),
        migration_fixed_ms=mig.non_negative("fixed_ms", required=False) or 0.0,
        gpu_memory_bytes=int(mem.positive("gpu_bytes")) if mem else None,
        reserved_memory_bytes=int(mem.non_negative("reserved_bytes", required=False) or 0)
        if mem
        else 0,
        price_usd_per_gpu_hour=get.positive("price_usd_per_gpu_hour", required=False),
        passes_per_chunk=get.positive_int("passes_per_chunk", required=False) or 1,
        sources=get.sources(),
    )
    if profile.migration_fixed_ms > profile.migration_per_session_ms:
        raise ProfileError(
            source,
            f"migration.fixed_ms ({profile.migration_fixed_ms}) exceeds "
            f"migration.per_session_ms ({profile.migration_per_session_ms})",
        )
    if profile.capacity < 1:
        if profile.deadline_capacity < 1:
            why = (f"no batch meets the deadline: chunk_ms[0] = {chunk[0]} ms > "
                   f"deadline_ms = {profile.deadline_ms} ms")
        else:
            why = (f"not one session's state ({state_bytes} bytes) fits in "
                   f"memory.gpu_bytes - memory.reserved_bytes")
        raise ProfileError(source, f"capacity K would be 0: {why}")
    return profile


class _Fields:
    """Typed access to a JSON object with errors that name the field."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = "") -> None:
        self.raw = raw
        self.source = source
        self.prefix = prefix

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.raw:
            if required:
                raise ProfileError(self.source, f"missing field {self.prefix + key!r}")
            return None
        return self.raw[key]

    def text(self, key: str, required: bool = True) -> str | None:
        value = self._get(key, required)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise ProfileError(self.source, f"field {self.prefix + key!r} must be a non-empty string")
        return value

    def _number(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ProfileError(self.source, f"field {self.prefix + key!r} must be a finite number, got {value!r}")
        return float(value)

    def positive(self, key: str, required: bool = True) -> float | None:
        value = self._get(key, required)
        if value is None and not required:
            return None
        number = self._number(key, value)
        if number <= 0:
            raise ProfileError(self.source, f"field {self.prefix + key!r} must be > 0, got {value!r}")
        return number

    def positive_int(self, key: str, required: bool = True) -> int | None:
        value = self._get(key, required)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProfileError(self.source,
                               f"field {self.prefix + key!r} must be an integer >= 1, got {value!r}")
        return value

    def non_negative(self, key: str, required: bool = True) -> float | None:
        value = self._get(key, required)
        if value is None and not required:
            return None
        number = self._number(key, value)
        if number < 0:
            raise ProfileError(self.source, f"field {self.prefix + key!r} must be >= 0, got {value!r}")
        return number

    def list_of_positive(self, key: str) -> list[float]:
        value = self._get(key, True)
        if not isinstance(value, list) or not value:
            raise ProfileError(self.source, f"field {self.prefix + key!r} must be a non-empty list of numbers")
        out = []
        for i, item in enumerate(value):
            number = self._number(f"{key}[{i}]", item)
            if number <= 0:
                raise ProfileError(self.source, f"field {self.prefix}{key}[{i}] must be > 0, got {item!r}")
            out.append(number)
        return out

    def obj(self, key: str, required: bool = True) -> dict[str, Any] | None:
        value = self._get(key, required)
        if value is None and not required:
            return None
        if not isinstance(value, dict):
            raise ProfileError(self.source, f"field {self.prefix + key!r} must be an object")
        return value

    def sources(self) -> dict[str, str]:
        value = self.raw.get("sources", {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ProfileError(self.source, "field 'sources' must map field names to text")
        return dict(value)

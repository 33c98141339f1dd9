"""Latency model of one GPU kind running one model: a measured (or documented) table.

A profile is a contract between the worker (which measures one) and the scheduler (which plans
with one): a small JSON document (the shipped ones are in ``shared/profiles/``; docs/scheduler.md).
:func:`profile_from_dict` parses values; :func:`load_profile` reads a shipped profile by name or
any profile file by path::

    {
      "name": "h20-longlive-1.3b-nvlink",
      "gpu_kind": "H20", "model": "LongLive-1.3B", "interconnect": "nvlink",
      "chunk_ms": [420.0, 491.0, ...],       # time of one coalesced step at batch 1, 2, ...
      "passes_per_chunk": 5,                 # optional, default 1: model passes per chunk
      "prompt_switch_ms": 35.0,              # optional, default 0: what a prompt change adds
      "steps": {"full": 4, "chunk_ms": {"3": [...], "2": [...]}},  # optional: see below
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

``prompt_switch_ms`` (default 0) is what one session's prompt change adds to the chunk of the
pass it applies in (writing the new cross-attention and, with LongLive's KV re-cache,
recomputing the cached frames): the workers measure it. ``K`` leaves room for it, so a batch at
capacity still meets the deadline in a chunk where a viewer changes the prompt.

The latency of a GPU is ``chunk_ms(n)`` for its ``n`` active sessions; ``chunk_ms`` must be
non-decreasing in ``n`` (checked on load), which is what lets placement treat "the GPU whose
latency grows least" as "the least loaded GPU" among GPUs of one kind.

``steps`` (optional) describes the quality budget: a chunk may run fewer denoising steps than
the model's full count, down to an operator floor, while its GPU is over its budget. At ``s``
steps a chunk runs ``s + 1`` passes (the cache-write pass stays), each costing what it costs at
full steps, so :meth:`LatencyProfile.chunk_ms_at` derives ``chunk_ms(b) * (s + 1) / (full + 1)``
unless ``steps.chunk_ms`` holds a measured table (per batch 1..N, like ``chunk_ms``) for that
step count. ``steps.full`` is the model's full count; without it, ``passes_per_chunk - 1``
(when above 1, else 1). The shipped profiles derive: they need no ``steps`` key. At 3 of 4
steps a chunk takes 4/5 of its time, at 2 of 4 steps 3/5, so the largest batch that meets the
deadline, :meth:`LatencyProfile.max_batch_at`, grows (bounded, like K, by memory and by the
batches the table covers).

A pool may hold several GPU kinds, each with its own profile. The live service measures chunk
times per batch from the workers' heartbeats and turns them into a profile with
:func:`profile_from_measurements`, falling back to the shipped profile for what it has not
measured yet.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


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
    prompt_switch_ms: float = 0.0
    # ``steps.full`` as written (None: derived from passes_per_chunk) and the measured chunk
    # times at fewer steps, as (steps, per batch 1..N ms) pairs in ascending steps.
    steps_full: int | None = None
    steps_chunk_ms: tuple[tuple[int, tuple[float, ...]], ...] = ()
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    # ---- derived ------------------------------------------------------------------------

    @property
    def deadline_capacity(self) -> int:
        """Largest batch in the table whose chunk time, with one prompt switch in it, meets
        the deadline (0 if none)."""
        return self._deadline_batch(self.chunk_ms_table)

    def _deadline_batch(self, table: tuple[float, ...]) -> int:
        best = 0
        for batch, ms in enumerate(table, start=1):
            if ms + self.prompt_switch_ms <= self.deadline_ms:
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
        return _from_table(self.chunk_ms_table, batch)

    # ---- the quality budget -------------------------------------------------------------

    @property
    def full_steps(self) -> int:
        """The model's full count of denoising steps per chunk: ``steps.full``, else
        ``passes_per_chunk - 1`` (one pass writes the KV cache), else 1 (a chunk-level
        profile)."""
        if self.steps_full is not None:
            return self.steps_full
        return self.passes_per_chunk - 1 if self.passes_per_chunk > 1 else 1

    def _steps_table(self, steps: int) -> tuple[float, ...]:
        """Chunk times per batch at ``steps`` denoising steps: the measured table for that
        count when the profile has one, else derived from ``chunk_ms``."""
        if steps == self.full_steps:
            return self.chunk_ms_table
        for measured_steps, table in self.steps_chunk_ms:
            if measured_steps == steps:
                return table
        scale = (steps + 1) / (self.full_steps + 1)
        return tuple(ms * scale for ms in self.chunk_ms_table)

    def _check_steps(self, steps: int) -> None:
        if not 1 <= steps <= self.full_steps:
            raise ValueError(f"steps must be in 1..{self.full_steps} (full_steps), got {steps}")

    def chunk_ms_at(self, batch: int, steps: int) -> float:
        """Time of one chunk with ``batch`` active sessions when each chunk runs ``steps``
        denoising steps (``steps + 1`` passes): the measured table for ``steps`` when present,
        else ``chunk_ms(batch) * (steps + 1) / (full_steps + 1)``, since a pass costs the same
        whatever the step count (:meth:`pass_ms` is unchanged). Equal to ``chunk_ms`` at full
        steps. Raises ValueError for ``steps`` outside 1..full_steps."""
        self._check_steps(steps)
        return _from_table(self._steps_table(steps), batch)

    def max_batch_at(self, steps: int) -> int:
        """Largest batch whose chunk time at ``steps`` steps, with one prompt switch in it,
        meets the deadline, bounded by memory and by the batches the table covers (as K is):
        :attr:`capacity` at full steps, at least that at fewer. Raises ValueError for
        ``steps`` outside 1..full_steps."""
        self._check_steps(steps)
        k = self._deadline_batch(self._steps_table(steps))
        mem = self.memory_capacity
        return k if mem is None else min(k, mem)

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
        if self.prompt_switch_ms:
            out["prompt_switch_ms"] = self.prompt_switch_ms
        if self.steps_full is not None or self.steps_chunk_ms:
            steps: dict[str, Any] = {}
            if self.steps_full is not None:
                steps["full"] = self.steps_full
            if self.steps_chunk_ms:
                steps["chunk_ms"] = {str(s): list(t) for s, t in self.steps_chunk_ms}
            out["steps"] = steps
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


def _from_table(table: tuple[float, ...], batch: int) -> float:
    """``table[batch - 1]``, 0 for no batch, the last slope extended beyond the table."""
    if batch <= 0:
        return 0.0
    if batch <= len(table):
        return table[batch - 1]
    slope = table[-1] - table[-2] if len(table) >= 2 else table[-1]
    return table[-1] + slope * (batch - len(table))


# ---- loading and validation -----------------------------------------------------------------


def profile_from_dict(raw: Any, source: str = "<dict>") -> LatencyProfile:
    if not isinstance(raw, dict):
        raise ProfileError(source, "top level must be a JSON object")
    get = _Fields(raw, source)
    chunk = get.list_of_positive("chunk_ms")
    _check_non_decreasing(source, "chunk_ms", chunk)
    mig = _Fields(get.obj("migration"), source, prefix="migration.")
    mem = _Fields(get.obj("memory"), source, prefix="memory.") if get.present("memory") else None
    state_bytes = int(get.positive("state_bytes_per_session"))
    profile = LatencyProfile(
        name=get.text("name"),
        gpu_kind=get.text("gpu_kind"),
        model=get.text("model"),
        interconnect=get.text("interconnect") if get.present("interconnect") else "unknown",
        chunk_ms_table=tuple(chunk),
        deadline_ms=get.positive("deadline_ms"),
        state_bytes_per_session=state_bytes,
        migration_per_session_ms=mig.non_negative("per_session_ms"),
        migration_fixed_ms=mig.non_negative("fixed_ms") if mig.present("fixed_ms") else 0.0,
        gpu_memory_bytes=int(mem.positive("gpu_bytes")) if mem else None,
        reserved_memory_bytes=int(mem.non_negative("reserved_bytes"))
        if mem and mem.present("reserved_bytes")
        else 0,
        price_usd_per_gpu_hour=get.positive("price_usd_per_gpu_hour")
        if get.present("price_usd_per_gpu_hour")
        else None,
        passes_per_chunk=get.positive_int("passes_per_chunk")
        if get.present("passes_per_chunk")
        else 1,
        prompt_switch_ms=get.non_negative("prompt_switch_ms")
        if get.present("prompt_switch_ms")
        else 0.0,
        sources=get.sources(),
    )
    if get.present("steps"):
        profile = _with_steps(profile, get.obj("steps"), source)
    if profile.migration_fixed_ms > profile.migration_per_session_ms:
        raise ProfileError(
            source,
            f"migration.fixed_ms ({profile.migration_fixed_ms}) exceeds "
            f"migration.per_session_ms ({profile.migration_per_session_ms})",
        )
    if profile.capacity < 1:
        if profile.deadline_capacity < 1:
            why = (
                f"no batch meets the deadline: chunk_ms[0] = {chunk[0]} ms > "
                f"deadline_ms = {profile.deadline_ms} ms"
            )
        else:
            why = (
                f"not one session's state ({state_bytes} bytes) fits in "
                f"memory.gpu_bytes - memory.reserved_bytes"
            )
        raise ProfileError(source, f"capacity K would be 0: {why}")
    return profile


def _check_non_decreasing(source: str, key: str, table: list[float]) -> None:
    for batch in range(1, len(table)):
        if table[batch] < table[batch - 1]:
            raise ProfileError(
                source,
                f"{key} must be non-decreasing in batch size, but batch {batch + 1} "
                f"({table[batch]} ms) is faster than batch {batch} ({table[batch - 1]} ms)",
            )


def _with_steps(profile: LatencyProfile, raw: dict[str, Any], source: str) -> LatencyProfile:
    """``profile`` with the ``steps`` object applied: ``full`` must agree with
    ``passes_per_chunk`` (full steps + the cache-write pass) when the profile counts passes,
    and each measured table is keyed by a step count below full, non-empty, positive and
    non-decreasing in batch size, like ``chunk_ms``."""
    get = _Fields(raw, source, prefix="steps.")
    full = get.positive_int("full") if get.present("full") else None
    passes = profile.passes_per_chunk
    if full is not None and passes > 1 and full != passes - 1:
        raise ProfileError(
            source,
            f"steps.full ({full}) disagrees with passes_per_chunk ({passes}): a chunk runs "
            f"its steps plus one cache-write pass, so steps.full must be {passes - 1}",
        )
    profile = replace(profile, steps_full=full)
    if not get.present("chunk_ms"):
        return profile
    tables: list[tuple[int, tuple[float, ...]]] = []
    for key in get.obj("chunk_ms"):
        steps = int(key) if key.isdigit() else 0
        if not 1 <= steps < profile.full_steps or any(steps == s for s, _ in tables):
            raise ProfileError(
                source,
                f"steps.chunk_ms keys must be step counts 1..{profile.full_steps - 1} (below "
                f"the full count, whose times are chunk_ms), each once, got {key!r}",
            )
        table = _Fields(get.obj("chunk_ms"), source, prefix="steps.chunk_ms.").list_of_positive(key)
        _check_non_decreasing(source, f"steps.chunk_ms.{key}", table)
        tables.append((steps, tuple(table)))
    return replace(profile, steps_chunk_ms=tuple(sorted(tables)))


class _Fields:
    """Typed access to a JSON object with errors that name the field."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = "") -> None:
        self.raw = raw
        self.source = source
        self.prefix = prefix

    def present(self, key: str) -> bool:
        """The field is there and not null (an optional field may be left out either way)."""
        return self.raw.get(key) is not None

    def _get(self, key: str) -> Any:
        if key not in self.raw:
            raise ProfileError(self.source, f"missing field {self.prefix + key!r}")
        return self.raw[key]

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not value:
            raise ProfileError(
                self.source, f"field {self.prefix + key!r} must be a non-empty string"
            )
        return value

    def _number(self, key: str, value: Any) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ProfileError(
                self.source, f"field {self.prefix + key!r} must be a finite number, got {value!r}"
            )
        return float(value)

    def positive(self, key: str) -> float:
        value = self._get(key)
        number = self._number(key, value)
        if number <= 0:
            raise ProfileError(
                self.source, f"field {self.prefix + key!r} must be > 0, got {value!r}"
            )
        return number

    def positive_int(self, key: str) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProfileError(
                self.source, f"field {self.prefix + key!r} must be an integer >= 1, got {value!r}"
            )
        return value

    def non_negative(self, key: str) -> float:
        value = self._get(key)
        number = self._number(key, value)
        if number < 0:
            raise ProfileError(
                self.source, f"field {self.prefix + key!r} must be >= 0, got {value!r}"
            )
        return number

    def list_of_positive(self, key: str) -> list[float]:
        value = self._get(key)
        if not isinstance(value, list) or not value:
            raise ProfileError(
                self.source, f"field {self.prefix + key!r} must be a non-empty list of numbers"
            )
        out = []
        for i, item in enumerate(value):
            number = self._number(f"{key}[{i}]", item)
            if number <= 0:
                raise ProfileError(
                    self.source, f"field {self.prefix}{key}[{i}] must be > 0, got {item!r}"
                )
            out.append(number)
        return out

    def obj(self, key: str) -> dict[str, Any]:
        value = self._get(key)
        if not isinstance(value, dict):
            raise ProfileError(self.source, f"field {self.prefix + key!r} must be an object")
        return value

    def sources(self) -> dict[str, str]:
        value = self.raw.get("sources", {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ProfileError(self.source, "field 'sources' must map field names to text")
        return dict(value)


# ---- measured profiles ----------------------------------------------------------------------


def profile_from_measurements(
    measured: Mapping[int, float],
    fallback: LatencyProfile,
    name: str | None = None,
    pass_ms: Mapping[int, float] | None = None,
) -> LatencyProfile:
    """``fallback`` with its chunk times replaced by measured ones: what a worker kind does,
    as far as it has been seen to do it.

    ``measured`` maps batch sizes to chunk times in ms (e.g. the median over a window of the
    workers' heartbeats). Empty: ``fallback`` itself. Otherwise the table covers batches 1 to
    the larger of the fallback's length and the largest measured batch:

    * a measured batch takes its measurement;
    * between two measured batches, the straight line between them;
    * above the largest measured batch, the slope of the last two measured batches (with a
      single measurement: the fallback's curve scaled by measured / fallback at that batch);
    * below the smallest measured batch, the fallback's curve scaled the same way;

    then each entry is raised to at least the one before (noise may make batch 2 measure
    faster than batch 1; a profile's chunk times never decrease).

    ``pass_ms`` (optional) maps batch sizes to measured times of one batched pass. A worker
    with pass-level admission times a whole chunk only when every pass of it ran at one batch
    size, which under steady paced load is rare: its sessions drift out of phase, so whole
    chunks are measured at the small batches of a ramp-up and hardly ever at the batch it
    runs. Extrapolating from two such neighbouring batches turns a few ms of noise into a
    slope that moves K by several sessions. Passes are timed at every batch, so a batch with
    a pass time and no chunk time takes ``passes_per_chunk x pass time + overhead``, the
    overhead (encoding, delivery) being the median of ``chunk - passes_per_chunk x pass``
    over the batches measured both ways. Without such a batch pass times are not used: the
    overhead is unknown. A pass time above the pass time of a bigger batch is left out (a
    stalled pass, not the batch's cost). Everything else (deadline,
    passes per chunk, state size, migration, memory, price) is the fallback's, so K follows
    the measurements: the largest batch that meets the fallback's deadline.

    Raises :class:`ProfileError` for a batch that is not an integer >= 1, a time that is not
    a finite number > 0, or measurements under which not even one session meets the deadline
    (K would be 0)."""
    if not measured:
        return fallback
    source = "measurements"
    _check_measured(source, measured)
    if pass_ms:
        _check_measured(source, pass_ms, what="pass time")
        measured = _with_pass_times(measured, pass_ms, fallback.passes_per_chunk)
    points: list[tuple[int, float]] = []
    for batch, ms in sorted(measured.items()):
        points.append((batch, float(ms)))
    length = max(len(fallback.chunk_ms_table), points[-1][0])
    lo_batch, lo_ms = points[0]
    hi_batch, hi_ms = points[-1]
    lo_scale = lo_ms / fallback.chunk_ms(lo_batch)
    if len(points) >= 2:
        (b1, m1), (b2, m2) = points[-2], points[-1]
        slope = max(0.0, (m2 - m1) / (b2 - b1))
    table: list[float] = []
    k = 0  # index of the measured point at or above the batch being filled
    for batch in range(1, length + 1):
        while points[k][0] < batch and k < len(points) - 1:
            k += 1
        if batch < lo_batch:
            ms = fallback.chunk_ms(batch) * lo_scale
        elif batch > hi_batch:
            if len(points) >= 2:
                ms = hi_ms + slope * (batch - hi_batch)
            else:
                ms = fallback.chunk_ms(batch) * hi_ms / fallback.chunk_ms(hi_batch)
        elif points[k][0] == batch:
            ms = points[k][1]
        else:  # between points[k - 1] and points[k]
            (b1, m1), (b2, m2) = points[k - 1], points[k]
            ms = m1 + (m2 - m1) * (batch - b1) / (b2 - b1)
        table.append(max(ms, table[-1]) if table else ms)
    shown = ", ".join(f"{b}: {m:.1f}" for b, m in points)
    sources = {
        **fallback.sources,
        "chunk_ms": f"measured at batch {{{shown}}} ms; other batches from "
        f"{fallback.name} (profile_from_measurements)",
    }
    profile = replace(
        fallback,
        name=name or f"{fallback.name}+measured",
        chunk_ms_table=tuple(table),
        sources=sources,
    )
    if profile.capacity < 1:
        raise ProfileError(
            source,
            f"no batch meets the deadline: batch 1 takes {table[0]:.1f} ms "
            f"> deadline_ms = {fallback.deadline_ms} ms",
        )
    return profile


def _check_measured(source: str, measured: Mapping[int, float], what: str = "chunk time") -> None:
    for batch, ms in measured.items():
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ProfileError(source, f"batch sizes must be integers >= 1, got {batch!r}")
        if (
            isinstance(ms, bool)
            or not isinstance(ms, int | float)
            or not math.isfinite(ms)
            or ms <= 0
        ):
            raise ProfileError(
                source, f"{what} at batch {batch} must be a finite number > 0, got {ms!r}"
            )


def _with_pass_times(
    chunk_ms: Mapping[int, float], pass_ms: Mapping[int, float], passes_per_chunk: int
) -> dict[int, float]:
    """Chunk times per batch, with the batches timed only by their passes filled in (see
    :func:`profile_from_measurements`)."""
    # A bigger batch is never faster: a pass time above a bigger batch's is a pass that
    # stalled (a fresh worker's first passes, a session's state loading), not the cost of its
    # batch, and is left out. A live run (a worker replacing a killed one) timed batch 5 at
    # 553 ms and batch 6 at 155 ms; taken as measured, it made K 3 and asked for two GPUs it
    # released seconds later. (Lowered to batch 6's instead, it would make the top flat and
    # the extrapolation above it too.)
    kept: dict[int, float] = {}
    lowest = math.inf
    for batch in sorted(pass_ms, reverse=True):
        if pass_ms[batch] <= lowest:
            kept[batch] = lowest = pass_ms[batch]
    pass_ms = kept
    both = sorted(b for b in chunk_ms if b in pass_ms)
    out = {int(b): float(ms) for b, ms in chunk_ms.items()}
    if not both:
        return out
    overhead = max(
        0.0, statistics.median(chunk_ms[b] - passes_per_chunk * pass_ms[b] for b in both)
    )
    for batch, ms in pass_ms.items():
        if batch not in out:
            out[int(batch)] = passes_per_chunk * float(ms) + overhead
    return out


PROFILE_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "h20-longlive-1.3b-nvlink"


def available_profiles() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> LatencyProfile:
    """A shipped profile by name (``profiles/<name>.json``) or any profile JSON file by path.

    Raises :class:`ProfileError` naming the file and the field for anything malformed."""
    path = _resolve(name_or_path)
    source = str(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(source, f"not valid JSON ({exc})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(source, f"cannot be read ({exc})") from exc
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

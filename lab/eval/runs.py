"""One simulator run of one policy, as the evaluation needs it, and a pool to run many.

A :class:`RunSpec` names the trace (a built-in name or a path), the policy and its
parameters, the profile and the boot delay; :func:`execute` runs it in the simulator and
returns a :class:`RunSummary` with the figures the evaluation uses.  The policy is wrapped in
a recorder that samples, after every step, how many active sessions hold a slot (``served``)
and how many wait (``pending``): the served-slot integral gives each run its own provable
lower bound (see ``floor.py``), which also holds for runs that left sessions waiting.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lab.sim.catalog import load_trace
from lab.sim.traceio import Trace
from services.scheduler.core.cluster import ClusterView
from services.scheduler.core.policies import Policy
from services.scheduler.core.types import Decision, Event, RestoredGpu, RestoredSession
from shared.profile import LatencyProfile, load_profile

__all__ = ["RunSpec", "RunSummary", "execute", "prime_trace_cache", "run_all"]

DEFAULT_PROFILE = "h20-longlive-1.3b-nvlink"


@dataclass(frozen=True, slots=True)
class RunSpec:
    trace: str  # built-in trace name or path
    policy: str
    curve: str  # the curve (or role) this run belongs to, e.g. "round_robin", "sens_boot_0"
    params: tuple[tuple[str, Any], ...] = ()
    profile: str = DEFAULT_PROFILE
    boot_delay_s: float = 30.0
    detail: bool = False  # keep per-chunk latencies and the GPU timeline (for plots)

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(slots=True)
class RunSummary:
    spec: RunSpec
    cost_gpu_h: float
    cost_usd: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    attainment: float
    migrations: int
    scale_events: int
    peak_gpus: int
    decision_p99_ms: float
    served_floor_gpu_h: float  # integral of ceil(served(t) / K): this run's own lower bound
    unserved_session_s: float  # integral of waiting active sessions
    wall_s: float
    chunks: int = 0
    deadline_ms: float = 0.0
    latencies_ms: list[float] | None = None
    timeline: list[tuple[float, int, int]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Chunk periods served on time over those owed while sessions were active: a stream frozen
    # for 60 s misses 48 periods, not one chunk (``sim/viewer.py``). The measure of service.
    stall_adjusted_attainment: float = 1.0
    missed_periods: int = 0
    # The quality budget: the share of delivered chunks (in %) that ran fewer denoising steps
    # than the model's full count (0 for every policy that never reduces steps).
    reduced_pct: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.spec.policy,
            "params": {k: v for k, v in self.spec.params if k != "future"},
            "boot_delay_s": self.spec.boot_delay_s,
            "profile": self.spec.profile,
            "cost_gpu_hours": round(self.cost_gpu_h, 4),
            "cost_usd": round(self.cost_usd, 3),
            "latency_ms": {
                "p50": round(self.p50_ms, 1),
                "p99": round(self.p99_ms, 1),
                "max": round(self.max_ms, 1),
            },
            "deadline_attainment": round(self.attainment, 5),
            "stall_adjusted_attainment": round(self.stall_adjusted_attainment, 5),
            "missed_periods": self.missed_periods,
            "chunks": self.chunks,
            "reduced_pct": round(self.reduced_pct, 4),
            "migrations": self.migrations,
            "scale_events": self.scale_events,
            "peak_gpus": self.peak_gpus,
            "decision_ms_p99": round(self.decision_p99_ms, 4),
            "served_floor_gpu_hours": round(self.served_floor_gpu_h, 4),
            "unserved_session_seconds": round(self.unserved_session_s, 2),
        }


class _Recorder:
    """A policy that delegates everything to ``policy`` (or the run would measure another one)
    and samples served / pending sessions after each step."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.samples: list[tuple[float, int, int]] = [(0.0, 0, 0)]

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def autoscales(self) -> bool:
        return self.policy.autoscales

    @property
    def boot_delay_s(self) -> float:
        return self.policy.boot_delay_s

    @property
    def view(self) -> ClusterView:
        return self.policy.view

    def note_pass(self, gpu_id: str, ends_at: float) -> None:
        self.policy.note_pass(gpu_id, ends_at)

    def restore(
        self, gpus: Iterable[RestoredGpu], sessions: Iterable[RestoredSession], t: float
    ) -> None:
        self.policy.restore(gpus, sessions, t)

    def set_profile(self, kind: str, profile: LatencyProfile) -> None:
        self.policy.set_profile(kind, profile)

    def set_limits(self, min_gpus: int, max_gpus: int | None) -> None:
        self.policy.set_limits(min_gpus, max_gpus)

    def rho_max(self) -> float:
        return self.policy.rho_max()

    def current_rho_hat(self, t: float) -> tuple[float, float]:
        return self.policy.current_rho_hat(t)

    def step(self, event: Event) -> list[Decision]:
        out = self.policy.step(event)
        view = self.policy.view
        pending = len(view.pending)
        served = view.active_sessions - pending
        last = self.samples[-1]
        if last[1] != served or last[2] != pending:
            if last[0] == event.t:
                self.samples[-1] = (event.t, served, pending)
            else:
                self.samples.append((event.t, served, pending))
        return out

    def integrals(self, end: float, capacity: int) -> tuple[float, float]:
        """(integral of ceil(served / K) in GPU-s, integral of pending in session-s)."""
        gpu_s = waiting = 0.0
        for (t, served, pending), nxt in zip(
            self.samples, self.samples[1:] + [(end, 0, 0)], strict=True
        ):
            span = max(0.0, min(nxt[0], end) - t)
            gpu_s += span * math.ceil(served / capacity)
            waiting += span * pending
        return gpu_s, waiting


_TRACES: dict[str, Trace] = {}
_PROFILES: dict[str, LatencyProfile] = {}


def prime_trace_cache(traces: dict[str, Trace]) -> None:
    """Hand already loaded traces (by key) to :func:`execute` in this process."""
    _TRACES.update(traces)


def _trace(key: str) -> Trace:
    if key not in _TRACES:
        _TRACES[key] = load_trace(key)
    return _TRACES[key]


def _profile(name: str) -> LatencyProfile:
    if name not in _PROFILES:
        _PROFILES[name] = load_profile(name)
    return _PROFILES[name]


def execute(spec: RunSpec) -> RunSummary:
    """Run one spec in the simulator (deterministic; only ``wall_s`` varies)."""
    from lab.sim.simulator import make_policy, simulate

    trace = _trace(spec.trace)
    profile = _profile(spec.profile)
    params = dict(spec.params)
    if params.get("future"):
        params["future"] = trace
    recorder = _Recorder(
        make_policy(spec.policy, profile, boot_delay_s=spec.boot_delay_s, **params)
    )
    started = time.perf_counter()
    result = simulate(trace, recorder, profile, boot_delay_s=spec.boot_delay_s)
    wall = time.perf_counter() - started
    served_gpu_s, waiting = recorder.integrals(trace.duration, profile.capacity)
    lat = result.latency()
    return RunSummary(
        spec=spec,
        cost_gpu_h=result.cost_gpu_seconds / 3600.0,
        cost_usd=result.cost_usd,
        p50_ms=lat["p50"],
        p99_ms=lat["p99"],
        max_ms=lat["max"],
        attainment=result.deadline_attainment,
        migrations=result.migrations,
        scale_events=result.scale_events,
        peak_gpus=result.peak_gpus,
        decision_p99_ms=result.decision()["p99"],
        served_floor_gpu_h=served_gpu_s / 3600.0,
        unserved_session_s=waiting,
        wall_s=wall,
        chunks=result.chunks,
        deadline_ms=profile.deadline_ms,
        stall_adjusted_attainment=result.stall_adjusted_attainment,
        missed_periods=result.missed_periods,
        reduced_pct=result.reduced_pct,
        latencies_ms=list(result.latencies_ms) if spec.detail else None,
        timeline=list(result.timeline) if spec.detail else None,
    )


def _progress(total: int) -> Callable[[int], None]:
    stream = sys.stderr
    start = time.perf_counter()
    tty = stream.isatty()
    last = [-1.0]

    def update(done: int) -> None:
        frac = done / total if total else 1.0
        elapsed = time.perf_counter() - start
        if tty:
            bar = "#" * int(30 * frac)
            stream.write(f"\revaluate [{bar:<30}] {done}/{total} runs {elapsed:5.1f}s")
            if done == total:
                stream.write("\n")
            stream.flush()
        elif frac - last[0] >= 0.1 or done == total:
            last[0] = frac
            stream.write(f"evaluate: {done}/{total} runs, {elapsed:.1f}s\n")
            stream.flush()

    return update


def run_all(
    specs: Iterable[RunSpec], jobs: int | None = None, progress: bool = True
) -> Iterator[RunSummary]:
    """Run every spec, in worker processes when ``jobs`` > 1; yields in completion order."""
    specs = list(specs)
    jobs = jobs or min(2, os.cpu_count() or 1)
    update = _progress(len(specs)) if progress else (lambda done: None)
    if jobs <= 1:
        for k, spec in enumerate(specs, 1):
            yield execute(spec)
            update(k)
        return
    import multiprocessing as mp

    # Same trace together: each worker generates / reads a trace once.
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(jobs) as pool:
        for k, summary in enumerate(pool.imap_unordered(execute, specs, chunksize=2), 1):
            yield summary
            update(k)

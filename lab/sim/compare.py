"""The simulator beside a live replay: the same trace, time compression, boot delay, pool limits,
initial pool and latency profile, and the figures under the same keys.

``turboserve replay --compare-sim`` calls :func:`simulate_replay` with what it played and
:func:`error_pct` on the two documents. Both are pure (no I/O): the caller loads the trace, the
profile (the one the live workers measured) and the rho_hat table.

Keys (those of the replay's JSON): ``sessions``, ``chunks``, ``chunks_lost``, ``seq_repeats``,
``latency_ms`` (``p50``, ``p99``, ``max``), ``deadline_attainment``,
``stall_adjusted_attainment``, ``missed_periods`` (and ``missed_periods_at_start``, those
before a spell's first chunk), ``startup_ms`` (each first chunk: done minus the moment its
session became active; ``p50``, ``p99``, ``max``), ``cost_gpu_seconds``, ``migrations``, ``scale_out_events``,
``scale_in_events``, ``peak_gpus``. The simulator never loses or repeats a chunk (its
``chunks_lost`` and ``seq_repeats`` are 0 by construction); the definitions of latency and
attainment are those of :class:`~lab.sim.viewer.ServiceLedger`, which the replay
can feed with what its clients receive.
"""

from __future__ import annotations

import math
from typing import Any

from lab.sim.traceio import Trace, TraceEvent
from lab.sim.viewer import summary
from services.scheduler.core.autoscale import RhoTable
from shared.profile import LatencyProfile

__all__ = ["COMPARED", "compress", "error_pct", "simulate_replay"]

# The figures whose relative error the comparison reports (nested keys joined with a dot).
COMPARED = (
    "cost_gpu_seconds",
    "latency_ms.p50",
    "latency_ms.p99",
    "latency_ms.max",
    "deadline_attainment",
    "stall_adjusted_attainment",
    "missed_periods",
    "missed_periods_at_start",
    "startup_ms.p50",
    "startup_ms.p99",
    "migrations",
    "peak_gpus",
    "scale_out_events",
    "scale_in_events",
    "chunks",
    "sessions",
)


def compress(trace: Trace, speed: float) -> Trace:
    """``trace`` with every time divided by ``speed`` (what ``replay --speed`` plays)."""
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed must be a finite number > 0, got {speed}")
    if speed == 1.0:
        return trace
    events = tuple(TraceEvent(e.t / speed, e.session_id, e.event) for e in trace.events)
    return Trace(trace.name, events, trace.duration / speed)


def simulate_replay(
    trace: Trace,
    profile: LatencyProfile,
    *,
    speed: float = 1.0,
    boot_delay_s: float = 30.0,
    min_gpus: int = 1,
    max_gpus: int | None = None,
    initial_gpus: int = 1,
    policy: str = "turboserve",
    rho_table: RhoTable | None = None,
    tick_s: float = 0.5,
    chunk_period_s: float | None = None,
    lead_s: float | None = None,
    duration_s: float | None = None,
    parked_on_gpu: bool = True,
    **params: Any,
) -> dict[str, Any]:
    """Run the simulator as the replay ran the live system, and return its figures.

    ``trace`` is the uncompressed trace; ``speed`` the replay's time compression (the workers
    keep their real chunk period and boot delay, the sessions come and go ``speed`` times
    faster). ``profile``: the latency profile the live workers measured (or the one they
    emulate). ``initial_gpus``: the READY pool the replay started with; ``min_gpus`` /
    ``max_gpus``: the provisioner's limits. ``rho_table``: the table the live scheduler runs
    (None: the fixed rho_hat, or ``rho_hat=`` in ``params``). ``chunk_period_s`` / ``lead_s``:
    the workers' pacing (default: the profile's deadline, one period). ``duration_s``: how long
    the replay ran, in compressed seconds (default: the compressed trace's length).
    ``parked_on_gpu``: an idle session's state stays with the worker it was suspended on, and a
    resume elsewhere is a migration (as in the live mesh; the simulator's default is not)."""
    from lab.sim.policies import POLICIES
    from lab.sim.simulator import PolicyError, simulate

    played = compress(trace, speed)
    if duration_s is not None:
        played = Trace(
            played.name, tuple(e for e in played.events if e.t <= duration_s), duration_s
        )
    try:
        autoscales = POLICIES[policy].autoscales
    except KeyError as exc:
        raise PolicyError(exc.args[0]) from None
    policy_params: dict[str, Any]
    if autoscales:
        policy_params = {"initial_gpus": initial_gpus, "min_gpus": min_gpus, **params}
        if max_gpus is not None:
            policy_params["max_gpus"] = max_gpus
        if rho_table is not None:
            policy_params["rho_table"] = rho_table
        elif "rho_hat" not in params:
            policy_params["rho_table"] = None  # say so: no shipped table unless asked
    else:
        # A policy without autoscaling (static, no_autoscale): it keeps the pool it started
        # with, as the live scheduler running it does.
        policy_params = {"gpus": initial_gpus, **params}
    result = simulate(
        played,
        policy,
        profile,
        boot_delay_s=boot_delay_s,
        tick_s=tick_s,
        chunk_period_s=chunk_period_s,
        lead_s=lead_s,
        warm_start=False,
        parked_on_gpu=parked_on_gpu,
        **policy_params,
    )
    lat = result.latency()
    return {
        "sessions": result.sessions,
        "chunks": result.chunks,
        "chunks_lost": 0,
        "seq_repeats": 0,
        "latency_ms": {"p50": lat["p50"], "p99": lat["p99"], "max": lat["max"]},
        "deadline_attainment": round(result.deadline_attainment, 6),
        "stall_adjusted_attainment": round(result.stall_adjusted_attainment, 6),
        "missed_periods": result.missed_periods,
        "missed_periods_at_start": result.missed_periods_at_start,
        "startup_ms": summary(result.startups_ms),
        "cost_gpu_seconds": round(result.cost_gpu_seconds, 3),
        "migrations": result.migrations,
        "scale_out_events": result.scale_out_events,
        "scale_in_events": result.scale_in_events,
        "peak_gpus": result.peak_gpus,
    }


def error_pct(
    live: dict[str, Any], sim: dict[str, Any], keys: tuple[str, ...] = COMPARED
) -> dict[str, float | None]:
    """Relative error of the simulator against the live run, in percent, per key:
    ``100 * (sim - live) / live`` (nested keys joined with a dot, e.g. ``latency_ms.p99``).
    0 when both are 0; None when only the live value is 0 (no relative error exists) or a
    key is missing from either side."""
    out: dict[str, float | None] = {}
    for key in keys:
        a, b = _get(live, key), _get(sim, key)
        if a is None or b is None:
            out[key] = None
        elif a == 0:
            out[key] = 0.0 if b == 0 else None
        else:
            out[key] = round(100.0 * (b - a) / abs(a), 3)
    return out


def _get(doc: dict[str, Any], dotted: str) -> float | None:
    value: Any = doc
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)

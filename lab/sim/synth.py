"""Seven seeded synthetic session traces: six modelled on the paper's description of its
workload, and a steady, churny one that the paper's traces do not have.

What the paper says (``shared/design/paper.md``): sessions live from under 5 s to over two
minutes and flip between active and idle; within 30 minutes the number of active sessions
swings between about a dozen and over a hundred; traffic ranges from calm to very bursty.

How we model it (one generator, six rate shapes):
1. Arrivals are a Poisson process whose rate is piecewise constant per second. The rate
   shape is written as a *target active-session curve* A(t) and converted by Little's law,
   rate = A(t) / (mean lifetime * active share), so the shapes read in sessions, not rates.
2. Lifetimes are log-normal (median 40 s, sigma 1.0), clipped to [2 s, 15 min]: about 2% of
   sessions live under 5 s and about 14% over 2 minutes. (``churny``: median 12 s, sigma 0.6.)
3. Inside a session, active and idle spells alternate (exponential, means per trace; the
   session starts active). A session still alive at the end departs at the trace's end.
4. Bursty traces add *activation storms*: at random instants a share of the idle sessions
   re-activate within a couple of seconds (an event everyone reacts to), which is what makes
   the volatility of activations high.

``churny`` is the kind of workload public traces show and the paper's shapes do not: a
near-constant active count (about 60) made of many short sessions that flip between active
and idle every few seconds (active 6 s, idle 4 s on average). Nothing surges, yet activations
are frequent, and idle sessions are many but come back no faster than others leave.

Each trace is fully determined by its name and seed; :func:`builtin_traces` gives the seven
evaluation traces and :func:`training_traces` gives variants on other seeds and time scales
for the offline profiler, so the rho_hat table is never fitted on the evaluation traces.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lab.sim.traceio import Trace, TraceEvent

LIFETIME_MEDIAN_S = 40.0
LIFETIME_SIGMA = 1.0
LIFETIME_MIN_S = 2.0
LIFETIME_MAX_S = 900.0
DEFAULT_DURATION_S = 1800.0


# A target active-session curve: t (s) -> target active sessions, given the trace's generator.
Shape = Callable[[np.ndarray, np.random.Generator], np.ndarray]


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """One synthetic trace: a target active-session curve and its session behaviour."""

    name: str
    seed: int
    shape: Shape
    active_mean_s: float = 25.0
    idle_mean_s: float = 10.0
    storms_per_hour: float = 0.0  # activation storms (see module docstring, step 4)
    storm_share: float = 0.0  # share of idle sessions woken by a storm
    lifetime_median_s: float = LIFETIME_MEDIAN_S
    lifetime_sigma: float = LIFETIME_SIGMA
    duration_s: float = DEFAULT_DURATION_S
    description: str = ""


# ---- target active-session curves (t in seconds over [0, duration)) -------------------------


def _calm(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # One slow swell from a dozen to ~100 and back over the whole trace.
    return np.asarray(12 + 92 * np.sin(np.pi * t / t[-1]) ** 2, dtype=float)


def _diurnal(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Two 15-minute waves with a little wobble, 15..105.
    return np.asarray(
        60 + 42 * np.sin(2 * np.pi * t / 900 - np.pi / 2) + 4 * np.sin(2 * np.pi * t / 97),
        dtype=float,
    )


def _steps(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Plateaus lasting 3-6 minutes at random levels between 12 and 115.
    out = np.empty_like(t)
    start = 0
    level = 20.0
    while start < len(t):
        length = int(rng.uniform(180, 360))
        out[start : start + length] = level
        start += length
        level = float(rng.uniform(12, 115))
    return out


def _bursty(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # A base of ~25 with arrival bursts: every ~4 minutes a 40-80 s surge. Sessions outlive
    # a surge, so the surge's target is set above the ~100-120 active it actually produces.
    out = np.full_like(t, 25.0)
    s = float(rng.uniform(30, 120))
    while s < t[-1]:
        width = rng.uniform(40, 80)
        height = rng.uniform(120, 170)
        out += height * np.exp(-0.5 * ((t - s) / (width / 2)) ** 2)
        s += float(rng.exponential(240)) + 60
    return out


def _flash_crowd(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Quiet at ~14, a flash crowd to ~125 at 9 min decaying over ~6 min, a smaller one at 22.
    out = np.full_like(t, 14.0)
    for at, height, tau in ((540.0, 150.0, 360.0), (1320.0, 90.0, 200.0)):
        rise = np.clip((t - at) / 45.0, 0, 1)
        decay = np.exp(-np.clip(t - at - 45.0, 0, None) / tau)
        out += height * rise * decay
    return out


def _chaotic(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Regime switches every 20-90 s among levels 12..130: very bursty.
    out = np.empty_like(t)
    start = 0
    while start < len(t):
        length = int(rng.uniform(20, 90))
        out[start : start + length] = rng.choice([12, 25, 50, 80, 110, 130])
        start += length
    return out


def _churny(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Steady: about 60 active, a slow +-6 wobble; the churn is in the sessions, not the load.
    return 60 + 6 * np.sin(2 * np.pi * t / 420 + rng.uniform(0, 2 * np.pi))


_SHAPES: dict[str, tuple[Shape, dict[str, float], str]] = {
    "calm": (
        _calm,
        {"active_mean_s": 40.0, "idle_mean_s": 8.0},
        "one slow swell 12 -> ~100 -> 12; long active spells",
    ),
    "diurnal": (
        _diurnal,
        {"active_mean_s": 30.0, "idle_mean_s": 10.0},
        "two 15-minute waves between ~15 and ~105",
    ),
    "steps": (
        _steps,
        {"storms_per_hour": 4, "storm_share": 0.3},
        "plateaus of 3-6 minutes at random levels, a few activation storms",
    ),
    "bursty": (
        _bursty,
        {"active_mean_s": 20.0, "idle_mean_s": 12.0, "storms_per_hour": 10, "storm_share": 0.5},
        "base ~25 with 40-80 s arrival surges to ~120-150",
    ),
    "flash_crowd": (
        _flash_crowd,
        {"storms_per_hour": 6, "storm_share": 0.6},
        "quiet, then flash crowds to ~125 at 9 and 22 minutes",
    ),
    "chaotic": (
        _chaotic,
        {"active_mean_s": 15.0, "idle_mean_s": 8.0, "storms_per_hour": 20, "storm_share": 0.6},
        "regime switches every 20-90 s, 12..130",
    ),
    "churny": (
        _churny,
        {
            "active_mean_s": 6.0,
            "idle_mean_s": 4.0,
            "lifetime_median_s": 12.0,
            "lifetime_sigma": 0.6,
        },
        "steady ~60 active, many short sessions flipping every few seconds",
    ),
}
BUILTIN_NAMES: tuple[str, ...] = tuple(_SHAPES)
_BUILTIN_SEEDS = {name: 101 + i for i, name in enumerate(BUILTIN_NAMES)}


def spec(
    name: str, seed: int | None = None, duration_s: float = DEFAULT_DURATION_S, **overrides: float
) -> TraceSpec:
    """The spec of a named trace shape; ``seed`` defaults to the evaluation trace's seed."""
    if name not in _SHAPES:
        raise KeyError(f"unknown trace shape {name!r}; known: {', '.join(BUILTIN_NAMES)}")
    shape, params, desc = _SHAPES[name]
    merged = {**params, **overrides}
    return TraceSpec(
        name=name,
        seed=_BUILTIN_SEEDS[name] if seed is None else seed,
        shape=shape,
        duration_s=duration_s,
        description=desc,
        **merged,
    )


def generate(s: TraceSpec, name: str | None = None) -> Trace:
    """Generate the trace of a spec; the same spec always gives the same trace."""
    rng = np.random.default_rng(s.seed)
    n_bins = int(math.ceil(s.duration_s))
    t = np.arange(n_bins, dtype=float)
    target = np.clip(s.shape(t, rng), 0, None)
    active_share = s.active_mean_s / (s.active_mean_s + s.idle_mean_s)
    mean_life = _mean_lifetime(s.lifetime_median_s, s.lifetime_sigma)
    rate = target / (mean_life * active_share)
    # Little's law needs a warm system at t=0: seed the initial population as arrivals
    # spread over the first few seconds instead of starting from an empty cluster.
    counts = rng.poisson(rate)
    counts[:5] += rng.poisson(target[0] / 5.0, size=min(5, n_bins))
    arrivals = np.sort(
        np.concatenate([b + rng.random(c) for b, c in enumerate(counts) if c > 0] or [np.empty(0)])
    )
    storms = _storm_times(s, rng)
    events: list[tuple[float, int, str, str]] = []  # (t, order, sid, event)
    order = 0
    for i, t0 in enumerate(arrivals):
        sid = f"s{i:05d}"
        life = float(
            np.clip(
                rng.lognormal(math.log(s.lifetime_median_s), s.lifetime_sigma),
                LIFETIME_MIN_S,
                LIFETIME_MAX_S,
            )
        )
        for when, kind in _session_events(
            float(t0), min(float(t0) + life, s.duration_s), s, storms, rng
        ):
            events.append((round(when, 3), order, sid, kind))
            order += 1
    events.sort()
    return Trace(name or s.name, tuple(TraceEvent(e[0], e[2], e[3]) for e in events), s.duration_s)


def _mean_lifetime(median_s: float = LIFETIME_MEDIAN_S, sigma: float = LIFETIME_SIGMA) -> float:
    # Mean of the clipped log-normal, by quadrature on a fixed grid (deterministic).
    z = np.linspace(-6, 6, 4001)
    w = np.exp(-0.5 * z**2)
    life = np.clip(median_s * np.exp(sigma * z), LIFETIME_MIN_S, LIFETIME_MAX_S)
    return float((life * w).sum() / w.sum())


def _storm_times(s: TraceSpec, rng: np.random.Generator) -> np.ndarray:
    n = rng.poisson(s.storms_per_hour * s.duration_s / 3600.0)
    return np.sort(rng.uniform(0, s.duration_s, size=n))


def _session_events(
    t0: float, end: float, s: TraceSpec, storms: np.ndarray, rng: np.random.Generator
) -> list[tuple[float, str]]:
    """arrive, then alternating idle/active spells until ``end``, then depart."""
    out = [(t0, "arrive")]
    now, active = t0, True
    while True:
        if active:
            now += rng.exponential(s.active_mean_s)
        else:
            wake = now + rng.exponential(s.idle_mean_s)
            # An activation storm in this idle spell wakes the session early, 0-2 s after it.
            k = int(np.searchsorted(storms, now, side="right"))
            if k < len(storms) and storms[k] < wake and rng.random() < s.storm_share:
                wake = float(storms[k] + rng.uniform(0, 2))
            now = wake
        # Keep every spell at least a millisecond so rounding never reorders events.
        if now >= end - 0.002:
            break
        active = not active
        out.append((now, "active" if active else "idle"))
    out.append((end, "depart"))
    return out


def builtin_traces() -> list[Trace]:
    """The seven evaluation traces, 30 minutes each."""
    return [generate(spec(name)) for name in BUILTIN_NAMES]


def builtin_trace(name: str) -> Trace:
    return generate(spec(name))


SCALE_OFFSET_MAX_S = 40.0


def scaled(trace: Trace, scale: int, seed: int | None = None) -> Trace:
    """``scale`` copies of ``trace`` superposed, the load of a ``scale`` times larger cluster.

    Each copy is shifted later by its own random offset of 0-40 s and cut at the trace's
    duration: a session still alive there departs then, events after it are dropped. The
    offsets are drawn from ``seed`` (default: the built-in trace's seed, or a checksum of the
    trace's name), so the same trace and scale always give the same result. Session ids get a
    ``c<copy>-`` prefix, so they stay unique. Scale 1 is the trace itself; a larger scale is
    named ``<name>_x<scale>``."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    if scale == 1:
        return trace
    if seed is None:
        seed = _BUILTIN_SEEDS.get(trace.name, zlib.crc32(trace.name.encode()))
    offsets = np.random.default_rng(seed).uniform(0.0, SCALE_OFFSET_MAX_S, size=scale)
    end = trace.duration
    rows: list[tuple[float, int, int, str, str]] = []  # (t, copy, order, sid, event)
    for copy, offset in enumerate(offsets):
        alive: set[str] = set()
        for order, ev in enumerate(trace.events):
            t = round(ev.t + float(offset), 3)
            if t >= end:
                continue
            sid = f"c{copy}-{ev.session_id}"
            rows.append((t, copy, order, sid, ev.event))
            if ev.event == "arrive":
                alive.add(sid)
            elif ev.event == "depart":
                alive.discard(sid)
        rows.extend(
            (end, copy, len(trace.events) + i, sid, "depart") for i, sid in enumerate(sorted(alive))
        )
    rows.sort()
    return Trace(
        f"{trace.name}_x{scale}",
        tuple(TraceEvent(t, sid, kind) for t, _, _, sid, kind in rows),
        end,
    )


def training_traces(duration_s: float = 1200.0, variants: int = 2) -> list[Trace]:
    """Profiler traces: every shape on seeds disjoint from the evaluation ones (1000+), with
    the session dynamics jittered by up to +-30% so the table is not fitted to one setting."""
    out = []
    for v in range(variants):
        for i, name in enumerate(BUILTIN_NAMES):
            seed = 1000 + 37 * v + i
            jitter = np.random.default_rng(seed).uniform(0.7, 1.3, size=2)
            base = spec(name, seed=seed, duration_s=duration_s)
            s = spec(
                name,
                seed=seed,
                duration_s=duration_s,
                active_mean_s=base.active_mean_s * float(jitter[0]),
                idle_mean_s=base.idle_mean_s * float(jitter[1]),
            )
            out.append(generate(s, name=f"train_{name}_{v}"))
    return out

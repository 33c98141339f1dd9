"""The simulator's policies: the live scheduler's list (the core's ``LIVE_POLICIES``) and the
two that run only offline, added here by name.

``turboserve_q``
    turboserve with the quality budget always on: ``min_steps`` defaults to
    ``QUALITY_MIN_STEPS`` (live, the budget is turboserve with ``TURBOSERVE_MIN_STEPS`` set).
``clairvoyant``
    Our loop, with the same rho_hat (fixed, or the adaptive table fed by the same volatility
    tracker) and the same placement, but told the future: at time t it holds
    ``gpus_for(max active over [t, t + boot_delay_s + lookahead_slack_s])``, so it asks for a
    GPU exactly one boot delay (plus one tick) before it is needed and lets it go as soon as
    it is not needed within that horizon.  Needs ``future=`` (a trace: an object with
    ``events`` of ``(t, session_id, event)``, or a list of such rows), so the live scheduler
    cannot run it.  It takes no idle reserve and no peak cap from the table
    (``idle_reserve=0``, ``peak_rho=0`` unless given): it knows who comes back and how high the
    load goes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, replace

from services.scheduler.core.autoscale import gpus_for
from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller, Profiles
from services.scheduler.core.policies import (
    GPUS_ALIAS,
    LIVE_POLICIES,
    Policies,
    PolicySpec,
    autoscaling,
)

__all__ = [
    "POLICIES",
    "QUALITY_MIN_STEPS",
    "ClairvoyantConfig",
    "ClairvoyantController",
    "active_timeline",
]

# turboserve_q's floor of denoising steps unless given: 3 of a 4-step model's 4 (a chunk at 4/5
# of its time). Lower floors buy more room at more cost in quality (docs/evaluation.md).
QUALITY_MIN_STEPS = 3


class _RangeMax:
    """Max of a step function over [a, b] in O(1) per query (sparse table)."""

    def __init__(self, times: list[float], values: list[int]) -> None:
        # Nothing is active before the first event.
        times = [float("-inf"), *times]
        values = [0, *values]
        self.times = times
        table = [list(values)]
        span = 1
        while 2 * span <= len(values):
            prev = table[-1]
            table.append([max(prev[i], prev[i + span]) for i in range(len(prev) - span)])
            span *= 2
        self.table = table

    def query(self, a: float, b: float) -> int:
        lo = max(0, bisect.bisect_right(self.times, a) - 1)
        hi = max(lo, bisect.bisect_right(self.times, b) - 1)
        k = (hi - lo + 1).bit_length() - 1
        row = self.table[k]
        return max(row[lo], row[hi - (1 << k) + 1])


def active_timeline(future: object) -> tuple[list[float], list[int]]:
    """(times, active count from that time on) from a trace or rows of (t, sid, event)."""
    rows = getattr(future, "events", future)
    if not isinstance(rows, Iterable):
        raise TypeError(
            f"future must be a trace or rows of (t, session_id, event), got {type(future).__name__}"
        )
    active: set[str] = set()
    times: list[float] = []
    counts: list[int] = []
    for row in rows:
        t, sid, kind = (
            (row[0], row[1], row[2])
            if isinstance(row, tuple | list)
            else (row.t, row.session_id, row.event)
        )
        if kind in ("arrive", "active"):
            active.add(sid)
        else:
            active.discard(sid)
        if times and times[-1] == t:
            counts[-1] = len(active)
        else:
            times.append(float(t))
            counts.append(len(active))
    return times, counts


@dataclass(frozen=True, slots=True)
class ClairvoyantConfig(ControllerConfig):
    """``clairvoyant``: the controller's settings, the trace it will be run on (``future``,
    required) and how far past one boot delay it looks. The idle reserve stands in for the
    sessions that will come back, and the peak cap guesses from the past that load will not
    outgrow its recent peak; the clairvoyant knows both, so by default it takes neither and
    sizes for the true demand alone."""

    idle_reserve: float | None = 0.0
    peak_rho: float | None = 0.0
    future: object = None
    lookahead_slack_s: float = 1.0


class ClairvoyantController(Controller):
    def __init__(self, profiles: Profiles, config: ClairvoyantConfig) -> None:
        if config.future is None:
            raise TypeError("policy 'clairvoyant' needs future= (the trace it will be run on)")
        super().__init__(profiles, replace(config, name="clairvoyant", placement="least_loaded"))
        times, counts = active_timeline(config.future)
        self._demand = _RangeMax(times, counts)
        self.horizon_s = config.boot_delay_s + config.lookahead_slack_s

    def target_gpus(
        self, t: float, n_required: int, rho_max: float, budget: float, rho_hat: float, delta: float
    ) -> float:
        peak = max(n_required, self._demand.query(t, t + self.horizon_s))
        target = max(gpus_for(peak, self._cluster.capacity, rho_hat, delta), self.config.min_gpus)
        if self.config.max_gpus is not None:
            target = min(target, self.config.max_gpus)
        return target


# Every policy the simulator runs by name: the live ones and the offline ones.
POLICIES: Policies = LIVE_POLICIES.extended(
    autoscaling("turboserve_q", migrate=True, min_steps=QUALITY_MIN_STEPS),
    PolicySpec(
        "clairvoyant",
        ClairvoyantConfig,
        ClairvoyantController,
        autoscales=True,
        aliases=GPUS_ALIAS,
    ),
)

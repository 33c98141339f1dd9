"""The evaluation's extra policies, registered by name with the core's registry.

All are the core's :class:`Controller` (same cluster view, same placement, same scale-in by
drain) with a different answer to "how many GPUs now?" (the ``target_gpus`` hook):

``hpa``
    A reactive scaler in the style of Kubernetes' Horizontal Pod Autoscaler, the usual rival
    in production: every ``sync_s`` (15 s) it computes
    ``desired = ceil(current * utilisation / target)`` (utilisation = active sessions over
    K x ready GPUs, waiting sessions included), does nothing while the ratio is within the
    ``tolerance`` (0.1), scales up at once, and scales down only to the highest recommendation
    of the last ``stabilization_s`` (300 s, HPA's default down-scale window).  Placement is
    least-loaded without migration, as pods are never moved.  Parameter ``target`` (default
    0.7) is its utilisation target; ``rho_hat`` is accepted as another name for it.
``least_loaded_autoscale``
    What operators run today: least-loaded placement, no migration, and a conventional
    utilisation-threshold autoscaler (step scaling with cooldowns, as cloud autoscaling groups
    offer). Every ``period_s`` (10 s) it reads the utilisation ``u`` = active sessions over K x
    (ready + booting GPUs), waiting sessions included. Above ``high`` (default 0.8; ``rho_hat``
    is accepted as another name for it) it adds the GPUs that bring ``u`` back to ``high`` (at
    least one), then waits ``cooldown_out_s`` (30 s) before the next scale-out; below ``low``
    (default ``high - 0.3``) for ``cooldown_in_s`` (120 s) on end it removes one GPU (the
    least loaded, drained and released once its sessions leave: no migration), then waits
    ``cooldown_in_s`` again. No rho_hat table, no idle reserve, no volatility signal. Distinct
    from ``no_migration`` (the TurboServe autoscaler without migration, an ablation) and from
    ``hpa`` (proportional, 300 s down-scale stabilisation).
``clairvoyant``
    Our loop, with the same rho_hat (fixed, or the adaptive table fed by the same volatility
    tracker) and the same placement, but told the future: at time t it holds
    ``gpus_for(max active over [t, t + boot_delay_s + lookahead_slack_s])``, so it asks for a
    GPU exactly one boot delay (plus one tick) before it is needed and lets it go as soon as
    it is not needed within that horizon.  Needs ``future=`` (a trace: an object with
    ``events`` of ``(t, session_id, event)``, or a list of such rows).  It takes no idle
    reserve and no peak cap from the table (``idle_reserve=0``, ``peak_rho=0`` unless given):
    it knows who comes back and how high the load goes.
``turboserve_predictive``
    Our loop, with the GPU count sized for a short-horizon forecast of active sessions one
    boot delay ahead.  Default ``mode="sessions"``: Holt's linear trend (double exponential
    smoothing) on the number of *live* sessions (active + idle) sampled once per
    ``sample_s``, times the recent active share (an EWMA of active / live).  Active and idle
    spells last seconds, a boot tens of seconds, so the active count one boot delay ahead
    depends on the live population then far more than on who is active now; the reactive
    loop sees only the latter and scales in just before idle sessions come back.
    ``mode="active"`` runs Holt on the active count itself (the first version; it did worse).
    Burst detection: activations in the last sample above the window's mean +
    ``burst_sigma`` std make the forecast at least the current count plus that burst again.
    rho_hat and the hysteresis band still guard the deadline: it scales up when the current
    *or* forecast load leaves the band, and down only when both are below it
    (``hold_down=False``: the current load alone decides scale-in).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from services.scheduler.core.autoscale import gpus_for
from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller
from services.scheduler.core.policies import (
    Profiles,
    check_params,
    gpus_alias,
    register_policy,
)
from services.scheduler.core.types import Decision, Event, EventKind

__all__ = ["ClairvoyantController", "HpaController", "PredictiveController",
           "ThresholdController"]

_CONTROLLER_PARAMS = frozenset({
    "rho_hat", "delta", "boot_delay_s", "eta", "initial_gpus", "gpu_kind",
    "min_gpus", "max_gpus", "rho_table", "t0", "warmup_s", "idle_reserve", "retry_backoff_s",
    "gpu_id_prefix", "peak_rho", "peak_window_s", "peak_surge_s",
})


def _split(name: str, params: dict[str, Any], extra: Iterable[str],
           **switches: Any) -> tuple[ControllerConfig, dict[str, Any]]:
    """(the controller's config, the policy's own parameters) from ``params``."""
    own = frozenset(extra)
    check_params(name, params, _CONTROLLER_PARAMS | {"gpus"} | own)
    params = gpus_alias(name, params)
    shared = {k: v for k, v in params.items() if k not in own}
    return (ControllerConfig(name=name, **switches, **shared),
            {k: v for k, v in params.items() if k in own})


# ---- HPA-style reactive scaler ---------------------------------------------------------------

class HpaController(Controller):
    def __init__(self, profiles: Profiles, config: ControllerConfig, *, target: float = 0.7,
                 tolerance: float = 0.1, sync_s: float = 15.0,
                 stabilization_s: float = 300.0) -> None:
        if not 0 < target <= 1:
            raise ValueError(f"target utilisation must be in (0, 1], got {target}")
        super().__init__(profiles, config)
        self.target = target
        self.tolerance = tolerance
        self.sync_s = sync_s
        self.stabilization_s = stabilization_s
        self._next_sync = float("-inf")
        self._recommendations: deque[tuple[float, float]] = deque()
        self._last: tuple[float, float] | None = None

    def target_gpus(self, t: float, n_required: int, rho_max: float, budget: float,
                    rho_hat: float, delta: float) -> float:
        # The loop may ask more than once per event (scale-in pass, scale-out pass): the
        # answer of this sync stands until the next one.
        if self._last is not None and self._last[0] == t:
            return self._last[1]
        if t < self._next_sync:
            return budget
        self._next_sync = t + self.sync_s
        self._last = (t, self._recommend(t, n_required, budget))
        return self._last[1]

    def _recommend(self, t: float, n_required: int, budget: float) -> float:
        # Booting GPUs count as replicas at zero utilisation, as HPA treats unready pods.
        current = max(1, budget)
        utilisation = n_required / (self._cluster.capacity * current)
        ratio = utilisation / self.target
        desired = budget if abs(ratio - 1.0) <= self.tolerance else math.ceil(current * ratio)
        min_gpus, max_gpus = self.config.min_gpus, self.config.max_gpus
        desired = max(desired, min_gpus, 1 if n_required else min_gpus)
        if max_gpus is not None:
            desired = min(desired, max_gpus)
        # Down-scale stabilisation: the highest recommendation of the window wins.
        recs = self._recommendations
        recs.append((t, desired))
        while recs and recs[0][0] < t - self.stabilization_s:
            recs.popleft()
        if desired >= budget:
            return desired
        return min(budget, max(r for _, r in recs))


def _hpa(profiles: Profiles, **params: Any) -> HpaController:
    if "rho_hat" in params and "target" not in params:
        params = dict(params)
        params["target"] = params.pop("rho_hat")
    # rho_hat stays fixed (and unused by the hook): the table plays no part in HPA's rule.
    config, own = _split("hpa", params, {"target", "tolerance", "sync_s", "stabilization_s"},
                         migrate=False, placement="least_loaded")
    config = replace(config, rho_hat=own.get("target", 0.7), rho_table=None)
    return HpaController(profiles, config, **own)


# ---- clairvoyant --------------------------------------------------------------------------

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


def active_timeline(future: Any) -> tuple[list[float], list[int]]:
    """(times, active count from that time on) from a trace or rows of (t, sid, event)."""
    rows = getattr(future, "events", future)
    active: set[str] = set()
    times: list[float] = []
    counts: list[int] = []
    for row in rows:
        t, sid, kind = (row[0], row[1], row[2]) if isinstance(row, tuple | list) else (
            row.t, row.session_id, row.event)
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


class ClairvoyantController(Controller):
    def __init__(self, profiles: Profiles, config: ControllerConfig, *, future: Any,
                 lookahead_slack_s: float = 1.0) -> None:
        super().__init__(profiles, config)
        times, counts = active_timeline(future)
        self._demand = _RangeMax(times, counts)
        self.horizon_s = config.boot_delay_s + lookahead_slack_s

    def target_gpus(self, t: float, n_required: int, rho_max: float, budget: float,
                    rho_hat: float, delta: float) -> float:
        peak = max(n_required, self._demand.query(t, t + self.horizon_s))
        target = max(gpus_for(peak, self._cluster.capacity, rho_hat, delta), self.config.min_gpus)
        if self.config.max_gpus is not None:
            target = min(target, self.config.max_gpus)
        return target


def _clairvoyant(profiles: Profiles, **params: Any) -> ClairvoyantController:
    if "future" not in params:
        raise TypeError("policy 'clairvoyant' needs future= (the trace it will be run on)")
    # The idle reserve stands in for the sessions that will come back, and the peak cap
    # guesses from the past that load will not outgrow its recent peak; the clairvoyant knows
    # both, so by default it sizes for the true demand alone.
    params = {"idle_reserve": 0.0, "peak_rho": 0.0, **params}
    config, own = _split("clairvoyant", params, {"future", "lookahead_slack_s"},
                         placement="least_loaded")
    return ClairvoyantController(profiles, config, **own)


# ---- predictive ---------------------------------------------------------------------------

class PredictiveController(Controller):
    def __init__(self, profiles: Profiles, config: ControllerConfig, *, sample_s: float = 5.0,
                 alpha: float = 0.5, beta: float = 0.3, burst_sigma: float = 3.0,
                 window_s: float = 300.0, hold_down: bool = True, mode: str = "sessions",
                 share_alpha: float = 0.05) -> None:
        if mode not in ("sessions", "active"):
            raise ValueError(f"mode must be 'sessions' or 'active', got {mode!r}")
        super().__init__(profiles, config)
        self.hold_down = hold_down
        self.mode = mode
        self.share_alpha = share_alpha
        self._share: float | None = None  # EWMA of active / live sessions
        self.sample_s = sample_s
        self.alpha = alpha
        self.beta = beta
        self.burst_sigma = burst_sigma
        self._window = max(3, int(window_s / sample_s))
        self._level: float | None = None
        self._trend = 0.0
        self._next_sample = float("-inf")
        self._activations = 0
        self._history: deque[int] = deque(maxlen=self._window)
        self._burst = 0.0

    def step(self, event: Event) -> list[Decision]:
        if event.kind is EventKind.ARRIVE or event.kind is EventKind.ACTIVE:
            self._activations += 1
        if event.t >= self._next_sample:
            self._sample(event.t)
        return super().step(event)

    def _sample(self, t: float) -> None:
        cluster = self._cluster
        live = len(cluster.sessions)
        n = live if self.mode == "sessions" else cluster.n_active
        if live:
            share = cluster.n_active / live
            self._share = share if self._share is None else (
                self.share_alpha * share + (1 - self.share_alpha) * self._share)
        if self._level is None:
            self._level = float(n)
        else:
            previous = self._level
            self._level = self.alpha * n + (1 - self.alpha) * (previous + self._trend)
            self._trend = self.beta * (self._level - previous) + (1 - self.beta) * self._trend
        hist = self._history
        self._burst = 0.0
        if len(hist) >= 3:
            mean = sum(hist) / len(hist)
            std = math.sqrt(max(0.0, sum(x * x for x in hist) / len(hist) - mean * mean))
            if self._activations > mean + self.burst_sigma * max(std, 1.0):
                self._burst = float(self._activations - mean)
        hist.append(self._activations)
        self._activations = 0
        self._next_sample = t + self.sample_s

    def forecast(self) -> float:
        """Active sessions expected one boot delay from now."""
        if self._level is None:
            return 0.0
        ahead = self._level + self._trend * (self.config.boot_delay_s / self.sample_s)
        if self.mode == "sessions":
            # Active/idle spells are short next to a boot delay, so the active count one boot
            # delay ahead is about the live sessions then, times the share that is active.
            ahead *= self._share if self._share is not None else 1.0
        return max(ahead, self._cluster.n_active + self._burst)

    def target_gpus(self, t: float, n_required: int, rho_max: float, budget: float,
                    rho_hat: float, delta: float) -> float:
        capacity = self._cluster.capacity
        expected = max(0, math.ceil(self.forecast() - 1e-9))
        rho_future = expected / (capacity * max(1, budget))
        up = rho_max > rho_hat + delta or rho_future > rho_hat + delta
        down = rho_max < rho_hat - delta and (not self.hold_down or rho_future < rho_hat - delta)
        if not (up or down):
            return budget
        sized_for = max(n_required, expected) if (up or self.hold_down) else n_required
        target = max(gpus_for(sized_for, capacity, rho_hat, delta), self.config.min_gpus)
        if self.config.max_gpus is not None:
            target = min(target, self.config.max_gpus)
        return max(target, budget) if up else min(target, budget)


def _predictive(profiles: Profiles, **params: Any) -> PredictiveController:
    config, own = _split("turboserve_predictive", params,
                         {"sample_s", "alpha", "beta", "burst_sigma", "window_s", "hold_down",
                          "mode", "share_alpha"}, placement="least_loaded")
    return PredictiveController(profiles, config, **own)


# ---- conventional threshold autoscaler --------------------------------------------------------

class ThresholdController(Controller):
    def __init__(self, profiles: Profiles, config: ControllerConfig, *, high: float = 0.8,
                 low: float | None = None, period_s: float = 10.0,
                 cooldown_out_s: float = 30.0, cooldown_in_s: float = 120.0) -> None:
        low = high - 0.3 if low is None else low
        if not 0 < high <= 1 or not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high <= 1, got low={low}, high={high}")
        for key, value in (("period_s", period_s), ("cooldown_out_s", cooldown_out_s),
                           ("cooldown_in_s", cooldown_in_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be >= 0 and finite, got {value}")
        super().__init__(profiles, config)
        self.high, self.low = high, low
        self.period_s = period_s
        self.cooldown_out_s, self.cooldown_in_s = cooldown_out_s, cooldown_in_s
        self._next_eval = float("-inf")
        self._last_out = float("-inf")
        self._last_in = float("-inf")
        self._below_since: float | None = None
        self._last: tuple[float, float] | None = None

    def target_gpus(self, t: float, n_required: int, rho_max: float, budget: float,
                    rho_hat: float, delta: float) -> float:
        if self._last is not None and self._last[0] == t:
            return self._last[1]  # asked twice in one step: the same answer
        if t < self._next_eval:
            return budget
        self._next_eval = t + self.period_s
        target = self._decide(t, n_required, budget)
        self._last = (t, target)
        return target

    def _decide(self, t: float, n_required: int, budget: float) -> float:
        capacity = self._cluster.capacity
        u = n_required / (capacity * budget) if budget > 0 else (math.inf if n_required else 0.0)
        min_gpus, max_gpus = self.config.min_gpus, self.config.max_gpus
        if u > self.high:
            self._below_since = None
            if t - self._last_out < self.cooldown_out_s:
                return budget
            self._last_out = t
            target = max(budget + 1, math.ceil(n_required / (capacity * self.high) - 1e-9))
            return target if max_gpus is None else min(target, max_gpus)
        if u < self.low and budget > max(1, min_gpus):
            if self._below_since is None:
                self._below_since = t
            if (t - self._below_since >= self.cooldown_in_s
                    and t - max(self._last_in, self._last_out) >= self.cooldown_in_s):
                self._last_in = t
                return budget - 1
            return budget
        self._below_since = None
        return budget


def _least_loaded_autoscale(profiles: Profiles, **params: Any) -> ThresholdController:
    if "rho_hat" in params and "high" not in params:
        params = dict(params)
        params["high"] = params.pop("rho_hat")
    config, own = _split("least_loaded_autoscale", params,
                         {"high", "low", "period_s", "cooldown_out_s", "cooldown_in_s"},
                         migrate=False, placement="least_loaded")
    # rho_hat stays fixed (and unused by the hook): no table, no idle reserve.
    config = replace(config, rho_hat=own.get("high", 0.8), rho_table=None, idle_reserve=0.0,
                     peak_rho=0.0)
    return ThresholdController(profiles, config, **own)


register_policy("hpa", _hpa)
register_policy("clairvoyant", _clairvoyant)
register_policy("turboserve_predictive", _predictive)
register_policy("least_loaded_autoscale", _least_loaded_autoscale)

"""The rival policies the live scheduler may run, besides TurboServe's own: what production
runs today, and a forecasting variant of our loop. The core's list of live policies
(``policies.LIVE_POLICIES``) names them; the simulator and the evaluation run them as they run
the others (the offline-only clairvoyant is the lab's, ``lab.sim.policies``).

All are the core's :class:`Controller` (same cluster view, same placement, same scale-in by
drain) with a different answer to "how many GPUs now?" (the ``target_gpus`` hook):

``hpa``
    A reactive scaler in the style of Kubernetes' Horizontal Pod Autoscaler, the usual rival
    in production: every ``sync_s`` (15 s) it computes
    ``desired = ceil(current * utilisation / target)`` (utilisation = active sessions over
    K x ready GPUs, waiting sessions included), does nothing while the ratio is within the
    ``tolerance`` (0.1), scales up at once, and scales down only to the highest recommendation
    of the last ``stabilization_s`` (300 s, HPA's default down-scale window).  Placement is
    least-loaded without migration, as pods are never moved.  ``target`` (default
    0.7) is its utilisation target; ``rho_hat`` is another name for it in loose parameters.
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

import math
from collections import deque
from dataclasses import dataclass, replace

from services.scheduler.core.autoscale import gpus_for
from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller, Profiles
from services.scheduler.core.types import Decision, Event, EventKind

__all__ = [
    "HpaConfig",
    "HpaController",
    "PredictiveConfig",
    "PredictiveController",
    "ThresholdConfig",
    "ThresholdController",
]

# ---- HPA-style reactive scaler ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HpaConfig(ControllerConfig):
    """``hpa``: the controller's settings (its ``rho_hat`` and table are not used) and the
    scaler's own."""

    target: float = 0.7  # utilisation target
    tolerance: float = 0.1  # no change while utilisation / target is within 1 +- this
    sync_s: float = 15.0  # how often it recomputes
    stabilization_s: float = 300.0  # down-scale stabilisation window


class HpaController(Controller):
    def __init__(self, profiles: Profiles, config: HpaConfig) -> None:
        if not 0 < config.target <= 1:
            raise ValueError(f"target utilisation must be in (0, 1], got {config.target}")
        # rho_hat stays fixed (and unused by the hook): the table plays no part in HPA's rule.
        super().__init__(
            profiles,
            replace(
                config,
                name="hpa",
                migrate=False,
                placement="least_loaded",
                rho_hat=config.target,
                rho_table=None,
            ),
        )
        self.target = config.target
        self.tolerance = config.tolerance
        self.sync_s = config.sync_s
        self.stabilization_s = config.stabilization_s
        self._next_sync = float("-inf")
        self._recommendations: deque[tuple[float, float]] = deque()
        self._last: tuple[float, float] | None = None

    def target_gpus(
        self, t: float, n_required: int, rho_max: float, budget: float, rho_hat: float, delta: float
    ) -> float:
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


# ---- predictive ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PredictiveConfig(ControllerConfig):
    """``turboserve_predictive``: the controller's settings and the forecast's (see the module
    docstring)."""

    sample_s: float = 5.0  # how often it samples the count it forecasts
    alpha: float = 0.5  # Holt's level smoothing
    beta: float = 0.3  # Holt's trend smoothing
    burst_sigma: float = 3.0  # activations above mean + this many std are a burst
    window_s: float = 300.0  # the burst detector's window
    hold_down: bool = True  # scale in only when the forecast is below the band too
    mode: str = "sessions"  # forecast live sessions ("sessions") or active ones ("active")
    share_alpha: float = 0.05  # EWMA weight of the active share


class PredictiveController(Controller):
    def __init__(self, profiles: Profiles, config: PredictiveConfig) -> None:
        if config.mode not in ("sessions", "active"):
            raise ValueError(f"mode must be 'sessions' or 'active', got {config.mode!r}")
        if not (config.sample_s > 0 and math.isfinite(config.sample_s)):
            raise ValueError(f"sample_s must be > 0 and finite, got {config.sample_s}")
        super().__init__(
            profiles, replace(config, name="turboserve_predictive", placement="least_loaded")
        )
        self.hold_down = config.hold_down
        self.mode = config.mode
        self.share_alpha = config.share_alpha
        self._share: float | None = None  # EWMA of active / live sessions
        self.sample_s = config.sample_s
        self.alpha = config.alpha
        self.beta = config.beta
        self.burst_sigma = config.burst_sigma
        self._window = max(3, int(config.window_s / config.sample_s))
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
            self._share = (
                share
                if self._share is None
                else (self.share_alpha * share + (1 - self.share_alpha) * self._share)
            )
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

    def target_gpus(
        self, t: float, n_required: int, rho_max: float, budget: float, rho_hat: float, delta: float
    ) -> float:
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


# ---- conventional threshold autoscaler --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThresholdConfig(ControllerConfig):
    """``least_loaded_autoscale``: the controller's settings (its ``rho_hat``, table, idle
    reserve and peak cap are not used) and the step scaler's."""

    high: float = 0.8  # scale out above this utilisation
    low: float | None = None  # scale in below this one (None: high - 0.3)
    period_s: float = 10.0  # how often it reads the utilisation
    cooldown_out_s: float = 30.0  # wait after a scale-out
    cooldown_in_s: float = 120.0  # below low this long on end, and wait after a scale-in


class ThresholdController(Controller):
    def __init__(self, profiles: Profiles, config: ThresholdConfig) -> None:
        high = config.high
        low = high - 0.3 if config.low is None else config.low
        if not 0 < high <= 1 or not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high <= 1, got low={low}, high={high}")
        for key, value in (
            ("period_s", config.period_s),
            ("cooldown_out_s", config.cooldown_out_s),
            ("cooldown_in_s", config.cooldown_in_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be >= 0 and finite, got {value}")
        # rho_hat stays fixed (and unused by the hook): no table, no idle reserve.
        super().__init__(
            profiles,
            replace(
                config,
                name="least_loaded_autoscale",
                migrate=False,
                placement="least_loaded",
                rho_hat=high,
                rho_table=None,
                idle_reserve=0.0,
                peak_rho=0.0,
            ),
        )
        self.high, self.low = high, low
        self.period_s = config.period_s
        self.cooldown_out_s, self.cooldown_in_s = config.cooldown_out_s, config.cooldown_in_s
        self._next_eval = float("-inf")
        self._last_out = float("-inf")
        self._last_in = float("-inf")
        self._below_since: float | None = None
        self._last: tuple[float, float] | None = None

    def target_gpus(
        self, t: float, n_required: int, rho_max: float, budget: float, rho_hat: float, delta: float
    ) -> float:
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
            if (
                t - self._below_since >= self.cooldown_in_s
                and t - max(self._last_in, self._last_out) >= self.cooldown_in_s
            ):
                self._last_in = t
                return budget - 1
            return budget
        self._below_since = None
        return budget

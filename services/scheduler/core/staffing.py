"""``turboserve_staffing``: the pool sized for the demand one boot delay ahead, at a stated
confidence, instead of for a target utilisation.

A GPU asked for now serves from one boot delay B on, so the question the autoscaler answers
is "how many sessions may be active at t + B?", and its one knob is how sure it wants to be
(``confidence``, an operator's service level, not a utilisation). The parts:

1. **Sessions as a two-state chain.** Each live session is active or idle, flips active ->
   idle at rate ``d``, idle -> active at ``a``, and leaves from either state (``q_a``,
   ``q_i``). :class:`RateEstimator` estimates the four rates online: events over
   session-seconds of exposure, both decayed with time constant ``rate_window_s``, with the
   Poisson standard error of each (:func:`transition` gives the chance to be active at t + B).
2. **Arrivals and storms over the boot.** :class:`BootWindows` keeps the arrival counts of
   every B-long window of the last ``burst_window_s``; each arrival is thinned by its chance
   to be active and still there at t + B. The same windows' share of idle sessions woken
   shows storms: a storm wakes many at once, which independent flips never do. By default
   their mean and variance enter the forecast (the thinned count's variance, and the storms'
   beyond the flips' own), so the one confidence covers them too; with ``burst_quantile``
   set, that quantile of the counts is taken as the arrivals, and of the shares as a floor on
   an idle session's chance. With ``surge`` (the default) the next boot's arrivals are at
   least the last boot's: in a surge the long window's mean lags.
3. **Square-root staffing.** The active count at t + B is a sum of Bernoullis: its mean plus
   ``z`` standard deviations (``z`` the normal quantile of ``confidence``), the rates'
   uncertainty added to the variance by the delta method (:func:`demand_ahead`). Headroom
   grows as the square root of the load, so relative headroom shrinks as the pool grows.
4. **Signals that do not grow with the pool.** GPUs = that demand over K x ``fill``, never
   fewer than the active sessions of now need, plus the GPUs for what placement cannot pack
   (sessions waiting for a slot beyond what the booting GPUs will take). No maximum over
   GPUs (the fullest GPU's load grows with the pool's size) and no volatility table.
5. **Ski-rental scale-in.** A GPU is given back only once the demand has stayed below the
   pool for ``scale_in_delay_s`` (None: ``HOLD_BOOTS`` boot delays; the loop's stabilisation
   window): keeping a GPU that is no longer needed is cheaper than booting it again while a
   swing down may come back, and once it has cost about what a reboot costs (the boot itself
   plus the periods its sessions would wait), letting it go is.

Placement stays the loop's (soonest first chunk, min-max rebalance with migration); the
loop's rho_hat, table, idle reserve and peak cap play no part.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from statistics import NormalDist

from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller, Profiles
from services.scheduler.core.types import Decision, Event, EventKind

__all__ = [
    "BootWindows",
    "Demand",
    "Outlook",
    "RateEstimator",
    "Rates",
    "StaffingConfig",
    "StaffingController",
    "demand_ahead",
    "outlooks",
    "transition",
]

# Default scale-in hold, in boot delays. A wrong scale-in costs a boot (B GPU-seconds) and up
# to K sessions waiting B for a slot; the missed periods weigh far more than the GPU time, so
# the break-even hold is several boots (the training traces' sweep settles it).
HOLD_BOOTS = 6.0
# The B-long arrival windows are read on a grid of B / this (sliding sums of bins).
BINS_PER_BOOT = 6
# The chain's probabilities are recomputed at most this often (the rates drift slowly).
REFRESH_S = 1.0
_EPS = 1e-9
_SESSION_EVENTS = frozenset({EventKind.ARRIVE, EventKind.ACTIVE, EventKind.IDLE, EventKind.DEPART})


@dataclass(frozen=True, slots=True)
class Rates:
    """Per-session transition rates (per second) and their standard errors."""

    activate: float = 0.0  # idle -> active
    deactivate: float = 0.0  # active -> idle
    leave_active: float = 0.0
    leave_idle: float = 0.0
    sd: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # same order

    def values(self) -> tuple[float, float, float, float]:
        return (self.activate, self.deactivate, self.leave_active, self.leave_idle)

    def shifted(self, i: int, by: float) -> Rates:
        """These rates with rate ``i`` (in :meth:`values` order) moved by ``by`` (kept >= 0)."""
        v = list(self.values())
        v[i] = max(0.0, v[i] + by)
        return Rates(v[0], v[1], v[2], v[3], sd=self.sd)


def transition(rates: Rates, horizon_s: float) -> tuple[float, float]:
    """(P(active at +horizon | active now), P(active at +horizon | idle now)) for the chain
    whose transient states are active and idle (leaving is absorbing): the first column of
    exp(Q h), Q = [[-(d + q_a), d], [a, -(a + q_i)]], in closed form for a 2 x 2 matrix."""
    a, d, qa, qi = rates.values()
    p, q, r, s = -(d + qa), d, a, -(a + qi)
    h = horizon_s
    mu = (p + s) / 2
    w = math.sqrt(max(0.0, (p - s) ** 2 / 4 + q * r))
    cosh = math.cosh(w * h)
    sinh_w = math.sinh(w * h) / w if w * h > 1e-12 else h
    scale = math.exp(mu * h)
    # exp(Q h) = e^{mu h} [cosh(w h) I + sinh(w h) / w (Q - mu I)]; its first column.
    p_aa = scale * (cosh + sinh_w * (p - mu))
    p_ia = scale * sinh_w * r
    return min(1.0, max(0.0, p_aa)), min(1.0, max(0.0, p_ia))


def _arrival_survival(rates: Rates, horizon_s: float) -> float:
    """The chance that a session arriving (active) at a uniform time in the next
    ``horizon_s`` is active at its end: P_aa averaged over the time left (midpoint rule)."""
    n = 4
    return sum(transition(rates, horizon_s * (j + 0.5) / n)[0] for j in range(n)) / n


@dataclass(frozen=True, slots=True)
class Outlook:
    """The chain's chances over one horizon: to be active at its end for a session active
    now (``p_aa``), idle now (``p_ia``), or arriving during it (``p_new``)."""

    p_aa: float
    p_ia: float
    p_new: float

    @classmethod
    def of(cls, rates: Rates, horizon_s: float) -> Outlook:
        p_aa, p_ia = transition(rates, horizon_s)
        return cls(p_aa, p_ia, _arrival_survival(rates, horizon_s))

    def waking(self, share: float) -> Outlook:
        """This outlook with an idle session's chance raised to ``share`` of the idle waking
        within the horizon, each thinned as an arrival is (it woke at some time in it)."""
        p_ia = max(self.p_ia, share * self.p_new)
        return self if p_ia == self.p_ia else Outlook(self.p_aa, p_ia, self.p_new)

    def mean(self, n_active: int, n_idle: int, arrivals: float) -> float:
        return n_active * self.p_aa + n_idle * self.p_ia + arrivals * self.p_new

    def variance(self, n_active: int, n_idle: int, arrivals: float) -> float:
        """The variance of the sum of Bernoullis."""
        return (
            n_active * self.p_aa * (1 - self.p_aa)
            + n_idle * self.p_ia * (1 - self.p_ia)
            + arrivals * self.p_new * (1 - self.p_new)
        )


def outlooks(rates: Rates, horizon_s: float) -> tuple[Outlook, ...]:
    """The outlook at ``rates``, then at each rate moved up by its standard error (the delta
    method's points; a rate without one is left out)."""
    return (
        Outlook.of(rates, horizon_s),
        *(Outlook.of(rates.shifted(i, sd), horizon_s) for i, sd in enumerate(rates.sd) if sd > 0),
    )


@dataclass(frozen=True, slots=True)
class Demand:
    """The active count expected at t + B: its mean, its standard deviation, and the count
    sized for (mean + z sd)."""

    mean: float
    sd: float
    sized: float


def demand_ahead(
    n_active: int,
    n_idle: int,
    arrivals: float,
    chances: tuple[Outlook, ...],
    z: float,
    wake_share: float = 0.0,
    arrivals_var: float = 0.0,
    wake_var: float = 0.0,
) -> Demand:
    """Active sessions one horizon ahead: each active and idle session a Bernoulli of its
    chain's chance, ``arrivals`` thinned by their survival (``chances``: :func:`outlooks`);
    ``wake_share`` (the share of idle sessions a recent boot-long window woke, storms
    included) is a floor on an idle session's chance (:meth:`Outlook.waking`).
    The variance is the Bernoullis' plus the rates' uncertainty: for each rate, the change of
    the mean when it moves by its standard error, squared (the delta method; the rates are
    shared by every session, so this part grows with the square of the count). With
    ``arrivals`` a mean, ``arrivals_var`` is its count's variance (a thinned count's variance
    is E[A] p (1 - p) + p^2 Var[A]), and ``wake_var`` the variance of the share of idle
    sessions woken within the horizon beyond what independent flips give (storms: every idle
    session wakes with the same share, so it grows with the square of the idle count)."""
    if wake_share > 0:
        chances = tuple(c.waking(wake_share) for c in chances)
    base = chances[0]
    mean = base.mean(n_active, n_idle, arrivals)
    var = base.variance(n_active, n_idle, arrivals)
    for shifted in chances[1:]:
        var += (shifted.mean(n_active, n_idle, arrivals) - mean) ** 2
    var += base.p_new**2 * (arrivals_var + n_idle**2 * wake_var)
    sd = math.sqrt(max(0.0, var))
    return Demand(mean, sd, max(0.0, mean + z * sd))


class RateEstimator:
    """The four rates of the chain, online: for each, events and session-seconds of exposure
    in its source state, both decayed by exp(-age / ``window_s``). A rate is events over
    exposure, its standard error sqrt(events) / exposure (a Poisson count); with no event
    seen yet, one event's worth (1 / exposure), so a rate never seen is not known to be 0."""

    def __init__(self, window_s: float) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"rate_window_s must be > 0 and finite, got {window_s}")
        self.window_s = window_s
        self._t: float | None = None
        self._n_active = 0
        self._n_idle = 0
        self._exposure_active = 0.0
        self._exposure_idle = 0.0
        # activate, deactivate, leave_active, leave_idle
        self._counts = [0.0, 0.0, 0.0, 0.0]

    def advance(self, t: float, n_active: int, n_idle: int) -> None:
        """Move the clock to ``t``; the populations held since the last call accrue
        exposure, and ``n_active`` / ``n_idle`` hold from ``t`` on."""
        if self._t is not None and t > self._t:
            f = math.exp(-(t - self._t) / self.window_s)
            gained = self.window_s * (1 - f)  # the decayed integral of 1 over the gap
            self._exposure_active = self._exposure_active * f + self._n_active * gained
            self._exposure_idle = self._exposure_idle * f + self._n_idle * gained
            self._counts = [c * f for c in self._counts]
        if self._t is None or t > self._t:
            self._t = t
        self._n_active, self._n_idle = n_active, n_idle

    def count(self, which: int) -> None:
        """One event of rate ``which`` (activate 0, deactivate 1, leave_active 2,
        leave_idle 3) at the current time."""
        self._counts[which] += 1.0

    def rates(self) -> Rates:
        exposures = (
            self._exposure_idle,
            self._exposure_active,
            self._exposure_active,
            self._exposure_idle,
        )
        values: list[float] = []
        sds: list[float] = []
        for c, e in zip(self._counts, exposures, strict=True):
            if e <= _EPS:
                values.append(0.0)
                sds.append(0.0)
                continue
            values.append(c / e)
            sds.append(math.sqrt(max(c, 1.0)) / e)
        return Rates(
            values[0], values[1], values[2], values[3], sd=(sds[0], sds[1], sds[2], sds[3])
        )


class BootWindows:
    """Event counts in bins of ``horizon_s / BINS_PER_BOOT`` over the last ``window_s``, each
    bin with the population it started with (the ``base`` of its first observation), read
    over every ``horizon_s``-long window of complete bins (sliding by one bin):

    * :meth:`quantile`: the ``q`` quantile of the windows' counts (arrivals over a boot);
    * :meth:`share_quantile`: the ``q`` quantile of each window's count over the population
      its first bin started with (the share of idle sessions that woke within a boot: a storm
      that wakes many at once shows here, not in the independent flips of the chain).

    Fewer complete bins than one window: the count seen so far scaled up to a whole window
    (its share likewise). The bin of the first observation never counts: it holds the sessions
    found running when the loop started (a warm system reports them in at once), which are not
    events of the process."""

    def __init__(self, horizon_s: float, window_s: float) -> None:
        if not (math.isfinite(horizon_s) and horizon_s > 0):
            raise ValueError(f"horizon_s must be > 0 and finite, got {horizon_s}")
        if not (math.isfinite(window_s) and window_s >= horizon_s):
            raise ValueError(
                f"burst_window_s must be >= the boot delay ({horizon_s}), got {window_s}"
            )
        self.bin_s = horizon_s / BINS_PER_BOOT
        self.n_bins = max(BINS_PER_BOOT, int(round(window_s / self.bin_s)))
        self._bins: deque[list[int]] = deque()  # [bin index, count, base], oldest first
        self._first: int | None = None
        self._cache: tuple[int, tuple[float, float], list[int], list[float], int] | None = None

    def observe(self, t: float, base: int = 0) -> None:
        """Move the clock to ``t``; ``base`` is the population now (kept for a new bin)."""
        b = int(t // self.bin_s)
        if self._first is None:
            self._first = b
        if not self._bins or self._bins[-1][0] < b:
            self._bins.append([b, 0, base])

    def record(self, t: float, base: int = 0) -> None:
        """One event at ``t``."""
        self.observe(t, base)
        self._bins[-1][1] += 1

    def quantile(self, t: float, q: float) -> float:
        partial, sums, _ = self._read(t)
        return partial[0] if not sums else _upper_quantile(sums, q)

    def share_quantile(self, t: float, q: float) -> float:
        partial, _, shares = self._read(t)
        return partial[1] if not shares else _upper_quantile(shares, q)

    def latest(self, t: float) -> float:
        """The count of the most recent complete window (the scaled-up partial count before
        there is one)."""
        partial, sums, _ = self._read(t)
        return float(self._cache[4]) if sums and self._cache is not None else partial[0]

    def recent(self, t: float, span_s: float) -> float:
        """The events of the last ``span_s`` (whole bins, the current partial one included)
        as a rate, scaled to one horizon: a surge's onset, before a whole window sees it."""
        current = int(t // self.bin_s)
        n_back = max(1, int(round(span_s / self.bin_s)))
        lo = current - n_back
        if self._first is not None:
            lo = max(lo, self._first + 1)
        # At least ``span_s``: a bin just begun (or the first bins after the found sessions)
        # would scale a handful of events up to a surge.
        elapsed = max(t - lo * self.bin_s, span_s)
        count = sum(c for b, c, _ in self._bins if b >= lo)
        return count * (self.bin_s * BINS_PER_BOOT) / elapsed

    def moments(self, t: float) -> tuple[float, float]:
        """Mean and variance of the windows' counts (fewer bins than a window: the count
        scaled up, variance 0)."""
        partial, sums, _ = self._read(t)
        return _moments(sums) if sums else (partial[0], 0.0)

    def share_moments(self, t: float) -> tuple[float, float]:
        """Mean and variance of the windows' shares, as :meth:`moments` reads counts."""
        partial, _, shares = self._read(t)
        return _moments(shares) if shares else (partial[1], 0.0)

    def _read(self, t: float) -> tuple[tuple[float, float], list[int], list[float]]:
        current = int(t // self.bin_s)
        if self._cache is None or self._cache[0] != current:
            self._cache = (current, *self._windows(current))
        return self._cache[1], self._cache[2], self._cache[3]

    def _windows(self, current: int) -> tuple[tuple[float, float], list[int], list[float], int]:
        if self._first is None:
            return (0.0, 0.0), [], [], 0
        lo = max(self._first + 1, current - self.n_bins)
        while self._bins and self._bins[0][0] < lo:
            self._bins.popleft()
        n = max(0, current - lo)
        counts = [0] * n
        bases = [0] * n
        last_base = 0
        for b, c, base in self._bins:
            if b >= current:
                break
            counts[b - lo] = c
            bases[b - lo] = base
        for i in range(n):  # a bin without an observation starts where the last one was
            if bases[i] == 0:
                bases[i] = last_base
            last_base = bases[i]
        if n < BINS_PER_BOOT:
            if not n:
                return (0.0, 0.0), [], [], 0
            seen = sum(counts) * BINS_PER_BOOT / n
            return (seen, min(1.0, seen / bases[0]) if bases[0] else 0.0), [], [], 0
        run = sum(counts[:BINS_PER_BOOT])
        sums = [run]
        for i in range(BINS_PER_BOOT, n):
            run += counts[i] - counts[i - BINS_PER_BOOT]
            sums.append(run)
        shares = [min(1.0, c / bases[i]) if bases[i] else 0.0 for i, c in enumerate(sums)]
        latest = sums[-1]
        sums.sort()
        shares.sort()
        return (0.0, 0.0), sums, shares, latest


def _moments(values: list[int] | list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, max(0.0, sum(v * v for v in values) / n - mean * mean)


def _upper_quantile(ordered: list[int] | list[float], q: float) -> float:
    """The ``q`` quantile of an ascending list (nearest rank, upper)."""
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


@dataclass(frozen=True, slots=True)
class StaffingConfig(ControllerConfig):
    """``turboserve_staffing``: the loop's settings (its rho_hat, table, idle reserve and peak
    cap are not used) and the demand model's. ``scale_in_delay_s`` is the ski-rental hold
    (None: ``HOLD_BOOTS`` boot delays)."""

    # The chance that the demand at t + B fits the pool (0.99: the cheapest setting that served
    # 99% of periods on every training trace it was swept on).
    confidence: float = 0.99
    rate_window_s: float = 120.0  # time constant of the rate estimates
    burst_window_s: float = 900.0  # the past whose B-long arrival and wake counts are read
    # Which of those counts is taken for the next boot; None: their mean and variance, the
    # variance then covered by the confidence like the rest.
    burst_quantile: float | None = None
    fill: float = 1.0  # share of K a GPU is sized to hold
    # The arrivals of the next boot at least those of the last one (a surge's trend).
    surge: bool = True
    # The arrivals of the next boot at least the rate of the last this many seconds over a
    # boot (None: off): a flash crowd's onset, seen before a whole boot-long window holds it.
    surge_recent_s: float | None = None
    # Slots per GPU kept for churn: this many times the sessions expected to leave a full
    # GPU's batch (active -> idle, departures) within one chunk period, from the online rates.
    # Their void chunks still run while their places are refilled (0: off).
    churn_slots: float = 0.0
    # The churn slots beside the demand's own headroom, not on top of it: the pool holds the
    # larger of the two (the sized count at K x fill, or the mean at K x fill less the churn
    # slots). The demand's headroom grows as the square root of the load and churn's in
    # proportion to it, so a small pool pays for its spread and a large one for its churn,
    # never both.
    churn_beside: bool = False
    scale_in_delay_s: float | None = None
    # Scale-event band: a scale-out asks for this share more than the target, and a target
    # within this share below the pool keeps the pool (0: off). Fewer, larger scale events.
    band: float = 0.0

    def __post_init__(self) -> None:
        ControllerConfig.__post_init__(self)
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")
        if self.burst_quantile is not None and not 0 <= self.burst_quantile <= 1:
            raise ValueError(f"burst_quantile must be in [0, 1], got {self.burst_quantile}")
        if not 0 < self.fill <= 1:
            raise ValueError(f"fill must be in (0, 1], got {self.fill}")
        if not (math.isfinite(self.band) and 0 <= self.band < 1):
            raise ValueError(f"band must be in [0, 1), got {self.band}")
        if not (math.isfinite(self.churn_slots) and self.churn_slots >= 0):
            raise ValueError(f"churn_slots must be >= 0, got {self.churn_slots}")
        if self.surge_recent_s is not None and not (
            math.isfinite(self.surge_recent_s) and self.surge_recent_s > 0
        ):
            raise ValueError(f"surge_recent_s must be > 0, got {self.surge_recent_s}")
        for key in ("rate_window_s", "burst_window_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be > 0 and finite, got {value}")

    @property
    def hold_s(self) -> float:
        """The scale-in hold in force."""
        if self.scale_in_delay_s is None:
            return HOLD_BOOTS * self.boot_delay_s
        return self.scale_in_delay_s


class StaffingController(Controller):
    def __init__(self, profiles: Profiles, config: StaffingConfig) -> None:
        super().__init__(
            profiles,
            replace(
                config,
                name="turboserve_staffing",
                placement="soonest_first_chunk",
                rho_table=None,
                idle_reserve=0.0,
                peak_rho=0.0,
                scale_in_delay_s=config.hold_s,
            ),
        )
        self.z = NormalDist().inv_cdf(config.confidence)
        self.horizon_s = config.boot_delay_s
        self.burst_quantile = config.burst_quantile
        self.fill = config.fill
        self.surge = config.surge
        self.surge_recent_s = config.surge_recent_s
        self.churn_slots = config.churn_slots
        self.churn_beside = config.churn_beside
        self.band = config.band
        self.period_s = self._cluster.profile.deadline_ms / 1000.0  # one chunk period
        self.estimator = RateEstimator(config.rate_window_s)
        window = max(config.burst_window_s, self.horizon_s)
        self.arrivals = BootWindows(self.horizon_s, window) if self.horizon_s > 0 else None
        self.wakes = BootWindows(self.horizon_s, window) if self.horizon_s > 0 else None
        self._rates_at: float | None = None
        self._chances = outlooks(Rates(), self.horizon_s)

    def step(self, event: Event) -> list[Decision]:
        self._observe(event)
        return super().step(event)

    def _observe(self, event: Event) -> None:
        """Feed the rate estimates and the arrival windows, from the session's state before
        the event is applied."""
        cluster = self._cluster
        n_active = cluster.n_active
        n_idle = len(cluster.sessions) - n_active
        self.estimator.advance(event.t, n_active, n_idle)
        if self.arrivals is not None and self.wakes is not None:
            self.arrivals.observe(event.t)
            self.wakes.observe(event.t, n_idle)
        kind = event.kind
        if kind not in _SESSION_EVENTS:
            return
        session = cluster.sessions.get(event.session_id) if event.session_id else None
        if session is None:
            if kind is EventKind.ARRIVE or kind is EventKind.ACTIVE:
                if self.arrivals is not None:
                    self.arrivals.record(event.t)
            return
        if kind is EventKind.ACTIVE or kind is EventKind.ARRIVE:
            if not session.active:
                self.estimator.count(0)
                if self.wakes is not None:
                    self.wakes.record(event.t, n_idle)
        elif kind is EventKind.IDLE:
            if session.active:
                self.estimator.count(1)
        else:
            self.estimator.count(2 if session.active else 3)

    def demand(self, t: float) -> Demand:
        """The active count expected one boot delay from ``t``, at the configured confidence."""
        cluster = self._cluster
        n_active = cluster.n_active
        if self.arrivals is None or self.wakes is None:
            return Demand(float(n_active), 0.0, float(n_active))
        if self._rates_at is None or t - self._rates_at >= REFRESH_S:
            self._chances = outlooks(self.estimator.rates(), self.horizon_s)
            self._rates_at = t
        n_idle = len(cluster.sessions) - n_active
        q = self.burst_quantile
        if q is not None:
            arrivals = self.arrivals.quantile(t, q)
            wake = self.wakes.share_quantile(t, q)
            return demand_ahead(n_active, n_idle, arrivals, self._chances, self.z, wake)
        arrivals, arrivals_var = self.arrivals.moments(t)
        rate = arrivals  # the window's mean, per boot
        if self.surge:
            # A surge under way: the last boot's arrivals say more of the next boot's than
            # the long window's mean, which dilutes them.
            arrivals = max(arrivals, self.arrivals.latest(t))
        if self.surge_recent_s is not None:
            # The last few seconds against the window's rate: only a count the window's
            # rate would not give at this confidence (its Poisson spread, or the windows' own
            # where they are over-dispersed) is read as a surge's onset.
            recent = self.arrivals.recent(t, self.surge_recent_s)
            share = min(1.0, self.surge_recent_s / self.horizon_s)
            spread = max(arrivals_var, rate) * share  # over-dispersed windows: their variance
            if recent * share > rate * share + self.z * math.sqrt(max(spread, 1.0)):
                arrivals = max(arrivals, recent)
        wake_mean, wake_var = self.wakes.share_moments(t)
        # Independent flips alone give the share a binomial variance; only the excess is the
        # storms' (the chain's Bernoullis hold the rest).
        excess = max(0.0, wake_var - wake_mean * (1 - wake_mean) / max(1, n_idle))
        return demand_ahead(
            n_active,
            n_idle,
            arrivals,
            self._chances,
            self.z,
            arrivals_var=arrivals_var,
            wake_var=excess,
        )

    def target_gpus(
        self, t: float, n_required: int, rho_max: float, budget: float, rho_hat: float, delta: float
    ) -> float:
        cluster = self._cluster
        capacity = cluster.capacity
        per_gpu = capacity * self.fill
        demand = self.demand(t)
        target = math.ceil(n_required / capacity - _EPS)
        if self.churn_slots > 0:
            # Sessions leaving a full GPU within one chunk period: their places are refilled
            # while their void chunks still run, so the batch is briefly over K.
            r = self.estimator.rates()
            leave = r.deactivate + r.leave_active
            churned = max(1.0, per_gpu - self.churn_slots * capacity * leave * self.period_s)
            if self.churn_beside:
                target = max(
                    target,
                    math.ceil(demand.sized / per_gpu - _EPS),
                    math.ceil(demand.mean / churned - _EPS),
                )
            else:
                target = max(target, math.ceil(demand.sized / churned - _EPS))
        else:
            target = max(target, math.ceil(demand.sized / per_gpu - _EPS))
        # What placement cannot pack: sessions waiting for a slot beyond what the GPUs that
        # are booting will take (a pool with room in total, but not where it is needed).
        unpacked = len(cluster.pending) - capacity * len(cluster.booting)
        if unpacked > 0:
            target = max(target, math.ceil(budget) + math.ceil(unpacked / capacity - _EPS))
        if self.band > 0:
            if target > budget + _EPS:
                target = math.ceil(target * (1 + self.band) - _EPS)
            elif target >= budget * (1 - self.band) - _EPS:
                target = math.ceil(budget - _EPS)
        target = max(target, self.config.min_gpus)
        if self.config.max_gpus is not None:
            target = min(target, self.config.max_gpus)
        return float(target)

"""Autoscaling: target utilisation rho_hat with a hysteresis band, and adaptive rho_hat.

``scale`` is the paper's rule as a pure function. Its inputs:

* ``rho_max``: active sessions on the fullest READY GPU after placement, over K (above 1 when
  sessions wait for a slot);
* ``budget``: READY + BOOTING GPUs (a booting GPU counts from the moment it is asked for, so a
  request already in flight is not repeated on the next event).

It fires only outside the band: up when ``rho_max > rho_hat + delta``, down when
``rho_max < rho_hat - delta``; then ``M = ceil(N_req / (K * rho_hat))``. Two guards keep it
from flapping on integer loads: M is never below ``ceil(N_req / floor(K * (rho_hat + delta)))``
(a count whose balanced load would sit above the band and fire straight back up), and an "up"
never shrinks the pool nor a "down" grows it.

Adaptive rho_hat (paper: "volatility of activations"): :class:`VolatilityTracker` counts
activations (arrivals and idle->active flips) in fixed bins and reports a burstiness measure of
the per-bin counts over a sliding window; :class:`RhoTable` quantises it into 10 levels and
maps each to (rho_hat, delta). The paper measures the standard deviation; a Poisson count's
std grows as the square root of its rate, so that signal also rises with plain load and mixes
"busy" with "bursty". Our tables therefore use the *index of dispersion* (variance / mean of
the bin counts: 1 for Poisson arrivals at any rate, above 1 when arrivals cluster). The table
names its signal (``"signal": "dispersion"`` or ``"std"``; a table without the key is a std
table, as the old ones were). Each level may also carry an ``idle_reserve``: the share of idle
sessions the controller sizes the pool for as if active (absent means 0), a
``scale_in_delay_s`` (the scale-in stabilisation window) and a ``peak_rho`` (the peak cap; see
``loop.Controller``). The shipped table
(``services/scheduler/shipped/rho_table.json``) is written by ``turboserve sim profile`` and
loaded by the core's callers, who pass it in ``ControllerConfig.rho_table``; without a table
the core uses the fixed ``FALLBACK_RHO_HAT`` = 0.7 and ``FALLBACK_DELTA`` = 0.1, the paper's
own examples.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FALLBACK_RHO_HAT = 0.7
FALLBACK_DELTA = 0.1
LEVELS = 10
DEFAULT_WINDOW_S = 300.0
DEFAULT_BIN_S = 10.0
SIGNALS = ("dispersion", "std")
DEFAULT_SIGNAL = "dispersion"


def scale(
    n_required: int,
    rho_max: float,
    budget: float,
    capacity: int,
    rho_hat: float,
    delta: float,
    min_gpus: int = 1,
    max_gpus: int | None = None,
) -> float:
    """Target GPU count (READY + BOOTING); returning ``budget`` means no scale event.

    ``budget`` is a count of GPUs of capacity ``capacity``: an integer for a pool of one kind,
    possibly fractional for a pool of several kinds counted in units of one of them."""
    up = rho_max > rho_hat + delta
    down = rho_max < rho_hat - delta
    if not (up or down):
        return budget
    target = gpus_for(n_required, capacity, rho_hat, delta)
    target = max(target, min_gpus)
    if max_gpus is not None:
        target = min(target, max_gpus)
    return max(target, budget) if up else min(target, budget)


def gpus_for(n_required: int, capacity: int, rho_hat: float, delta: float) -> int:
    """M = ceil(N_req / (K rho_hat)), raised if needed so that the balanced load stays inside
    the band (see the module docstring)."""
    if n_required <= 0:
        return 0
    m = math.ceil(n_required / (capacity * rho_hat) - 1e-9)
    per_gpu_top = min(capacity, max(1, math.floor(capacity * (rho_hat + delta) + 1e-9)))
    return max(m, math.ceil(n_required / per_gpu_top))


class VolatilityTracker:
    """Activation counts per ``bin_s`` bin over the last ``window_s`` (complete bins only).

    :meth:`std` is the paper's measure (standard deviation of the counts); :meth:`dispersion`
    is variance / mean (0 when there were no activations at all); :meth:`value` is the one
    named by ``signal``, the measure a :class:`RhoTable` is indexed by. Bins before the first
    recorded time do not count, so every measure is defined from the third complete bin on;
    before that they return None."""

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        bin_s: float = DEFAULT_BIN_S,
        signal: str = DEFAULT_SIGNAL,
    ) -> None:
        if bin_s <= 0 or window_s < bin_s:
            raise ValueError(f"need 0 < bin_s <= window_s, got bin_s={bin_s}, window_s={window_s}")
        if signal not in SIGNALS:
            raise ValueError(f"unknown volatility signal {signal!r} (known: {', '.join(SIGNALS)})")
        self.bin_s = bin_s
        self.signal = signal
        self.n_bins = int(round(window_s / bin_s))
        self._bins: deque[list[int]] = deque()  # [bin index, count], oldest first
        self._first_bin: int | None = None
        self._cache: tuple[int, tuple[float, float] | None] | None = None

    def observe(self, t: float) -> None:
        """Advance the clock without an activation (keeps the first-bin origin right)."""
        if self._first_bin is None:
            self._first_bin = int(t // self.bin_s)

    def record(self, t: float) -> None:
        b = int(t // self.bin_s)
        if self._first_bin is None:
            self._first_bin = b
        if self._bins and self._bins[-1][0] == b:
            self._bins[-1][1] += 1
        else:
            self._bins.append([b, 1])
        # No cache reset: only complete bins count, and a record lands in the current one.

    def std(self, t: float) -> float | None:
        """Standard deviation of the per-bin counts (the paper's volatility)."""
        moments = self._moments(t)
        return None if moments is None else math.sqrt(moments[1])

    def dispersion(self, t: float) -> float | None:
        """Index of dispersion, variance / mean of the per-bin counts: 1 for Poisson arrivals
        whatever their rate, above 1 for clustered (bursty) ones, 0 without activations."""
        moments = self._moments(t)
        if moments is None:
            return None
        mean, var = moments
        return var / mean if mean > 0 else 0.0

    def value(self, t: float) -> float | None:
        """The measure named by ``signal``."""
        return self.dispersion(t) if self.signal == "dispersion" else self.std(t)

    def _moments(self, t: float) -> tuple[float, float] | None:
        current = int(t // self.bin_s)
        if self._cache is not None and self._cache[0] == current:
            return self._cache[1]
        value = self._compute(current)
        self._cache = (current, value)
        return value

    def _compute(self, current: int) -> tuple[float, float] | None:
        if self._first_bin is None:
            return None
        lo = max(self._first_bin, current - self.n_bins)
        n = current - lo  # complete bins in [lo, current)
        if n < 3:
            return None
        while self._bins and self._bins[0][0] < lo:
            self._bins.popleft()
        total = 0
        squares = 0
        for b, count in self._bins:
            if b >= current:
                break
            total += count
            squares += count * count
        mean = total / n
        return mean, max(0.0, squares / n - mean * mean)


@dataclass(frozen=True, slots=True)
class RhoTable:
    """Volatility level -> (rho_hat, delta). ``level_edges`` are the 9 ascending thresholds of
    the table's ``signal`` between the 10 levels (level = how many edges the signal reaches or
    exceeds)."""

    level_edges: tuple[float, ...]
    rho_hat: tuple[float, ...]
    delta: tuple[float, ...]
    window_s: float = DEFAULT_WINDOW_S
    bin_s: float = DEFAULT_BIN_S
    source: str = ""
    signal: str = "std"
    # Per level, the share of idle sessions the pool is sized for as if active (the
    # controller's ``idle_reserve``); empty means 0 at every level (tables without the key).
    idle_reserve: tuple[float, ...] = ()
    # Per level, the scale-in stabilisation window in seconds (the controller's
    # ``scale_in_delay_s``: the pool never shrinks below the highest target of the window);
    # empty means 0 at every level.
    scale_in_delay_s: tuple[float, ...] = ()
    # Per level, the peak cap's utilisation (the controller's ``peak_rho``: outside a surge
    # beyond it, the pool never holds more than the window's peak active count needs at that
    # utilisation; 0: no cap); empty means no cap at any level.
    peak_rho: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(
                f"rho table: unknown signal {self.signal!r} (known: {', '.join(SIGNALS)})"
            )
        if len(self.level_edges) != LEVELS - 1:
            raise ValueError(
                f"rho table: need {LEVELS - 1} level_edges, got {len(self.level_edges)}"
            )
        if list(self.level_edges) != sorted(self.level_edges):
            raise ValueError(f"rho table: level_edges must ascend, got {list(self.level_edges)}")
        if len(self.rho_hat) != LEVELS or len(self.delta) != LEVELS:
            raise ValueError(
                f"rho table: need {LEVELS} levels, got {len(self.rho_hat)} rho_hat "
                f"and {len(self.delta)} delta"
            )
        for i, (r, d) in enumerate(zip(self.rho_hat, self.delta, strict=True)):
            if not (0 < r <= 1) or not (0 <= d < r):
                raise ValueError(
                    f"rho table: level {i} needs 0 < rho_hat <= 1 and "
                    f"0 <= delta < rho_hat, got rho_hat={r}, delta={d}"
                )
        _check_per_level(
            "idle_reserve", self.idle_reserve, lambda x: 0 <= x <= 1, "0 <= idle_reserve <= 1"
        )
        _check_per_level(
            "scale_in_delay_s",
            self.scale_in_delay_s,
            lambda x: math.isfinite(x) and x >= 0,
            "scale_in_delay_s >= 0",
        )
        _check_per_level(
            "peak_rho", self.peak_rho, lambda x: 0 <= x <= 1, "0 <= peak_rho <= 1 (0: no cap)"
        )

    def level(self, value: float) -> int:
        return bisect.bisect_right(self.level_edges, value)

    def lookup(self, value: float) -> tuple[float, float]:
        i = self.level(value)
        return self.rho_hat[i], self.delta[i]

    def reserve(self, level: int) -> float:
        """The idle reserve at ``level`` (0 for a table without one)."""
        return self.idle_reserve[level] if self.idle_reserve else 0.0

    def scale_in_delay(self, level: int) -> float:
        """The scale-in delay at ``level`` (0 for a table without one)."""
        return self.scale_in_delay_s[level] if self.scale_in_delay_s else 0.0

    def peak_cap(self, level: int) -> float:
        """The peak cap's utilisation at ``level`` (0, no cap, for a table without one)."""
        return self.peak_rho[level] if self.peak_rho else 0.0

    def tracker(self) -> VolatilityTracker:
        """A fresh tracker measuring this table's signal over its window and bins."""
        return VolatilityTracker(self.window_s, self.bin_s, self.signal)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "window_s": self.window_s,
            "bin_s": self.bin_s,
            "signal": self.signal,
            "level_edges": list(self.level_edges),
            "levels": [
                {
                    "rho_hat": r,
                    "delta": d,
                    **({"idle_reserve": self.idle_reserve[i]} if self.idle_reserve else {}),
                    **(
                        {"scale_in_delay_s": self.scale_in_delay_s[i]}
                        if self.scale_in_delay_s
                        else {}
                    ),
                    **({"peak_rho": self.peak_rho[i]} if self.peak_rho else {}),
                }
                for i, (r, d) in enumerate(zip(self.rho_hat, self.delta, strict=True))
            ],
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RhoTable:
        try:
            levels = raw["levels"]
            return cls(
                level_edges=tuple(float(x) for x in raw["level_edges"]),
                rho_hat=tuple(float(x["rho_hat"]) for x in levels),
                delta=tuple(float(x.get("delta", FALLBACK_DELTA)) for x in levels),
                window_s=float(raw.get("window_s", DEFAULT_WINDOW_S)),
                bin_s=float(raw.get("bin_s", DEFAULT_BIN_S)),
                source=str(raw.get("source", "")),
                signal=str(raw.get("signal", "std")),
                idle_reserve=(
                    tuple(float(x.get("idle_reserve", 0.0)) for x in levels)
                    if any("idle_reserve" in x for x in levels)
                    else ()
                ),
                scale_in_delay_s=(
                    tuple(float(x.get("scale_in_delay_s", 0.0)) for x in levels)
                    if any("scale_in_delay_s" in x for x in levels)
                    else ()
                ),
                peak_rho=(
                    tuple(float(x.get("peak_rho", 0.0)) for x in levels)
                    if any("peak_rho" in x for x in levels)
                    else ()
                ),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"rho table: malformed ({exc!r})") from exc
        except ValueError as exc:
            if str(exc).startswith("rho table"):
                raise
            raise ValueError(f"rho table: malformed ({exc})") from exc


def _check_per_level(
    name: str, values: tuple[float, ...], ok: Callable[[float], bool], rule: str
) -> None:
    """An optional per-level column: empty, or one value per level, each meeting ``rule``."""
    if not values:
        return
    if len(values) != LEVELS:
        raise ValueError(f"rho table: need {LEVELS} {name} values, got {len(values)}")
    for i, x in enumerate(values):
        if not ok(x):
            raise ValueError(f"rho table: level {i} needs {rule}, got {x}")


class RhoTableError(ValueError):
    """A rho table file that cannot be used; the message names the file and the fault.
    Raised by the loader (``services.scheduler.shipped``); retrying cannot help."""

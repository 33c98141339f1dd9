"""The one quantile of the tree: every p50 and p99 the benches, the simulator and the profiler
report is read the same way, so a bench's figure and the simulator's compare.

Linear interpolation between the two nearest ranks: numpy's default method (type 7 of Hyndman
and Fan), what a reader checking a figure with ``numpy.percentile`` gets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["quantile", "quantiles"]


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (``q`` in [0, 1]) of ``values``; 0 for no values."""
    return quantiles(values, (q,))[0]


def quantiles(values: Iterable[float], qs: Sequence[float]) -> list[float]:
    """The quantiles ``qs`` of ``values``, sorted once; 0 each for no values."""
    ordered = sorted(values)
    if not ordered:
        return [0.0 for _ in qs]
    last = len(ordered) - 1
    out = []
    for q in qs:
        pos = last * q
        lo = math.floor(pos)
        hi = min(lo + 1, last)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out

"""Matched comparisons on cost-latency curves.

A curve is a set of (cost, latency) points, one per run of a policy (a GPU count, a rho_hat).
More money never has to buy worse latency -- a policy could always copy its cheaper setting
and leave the extra GPUs idle -- so we compare against a rival's *Pareto envelope*: the
points no other point beats on both axes, joined by straight lines.

- ``latency_at_cost(curve, c)``: the rival's latency interpolated at cost c.  Outside the
  rival's measured cost range we clamp to the nearest end point and say ``reached=False``:
  below its cheapest point the clamp understates our win (it would only be worse there);
  above its dearest point the clamp may overstate it (it might improve further), which is why
  every out-of-range match is flagged and counted in the report.
- ``cost_at_latency(curve, l)``: the cost the rival needs to reach latency l.  When l is
  better than any rival point, the rival never reaches it in the measured range; we report its
  dearest point's cost with ``reached=False`` (conservative: it would need at least that
  much).  When l is worse than its cheapest point, the clamp to that point's cost may
  overstate the rival's need, and is flagged the same way.

Reductions are in percent of the rival's value: ``100 * (rival - ours) / rival``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "CurvePoint",
    "Matched",
    "cost_at_latency",
    "cost_reduction_at_matched_latency",
    "latency_at_cost",
    "latency_reduction_at_matched_cost",
    "pareto_envelope",
    "reduction_pct",
]


@dataclass(frozen=True, slots=True)
class CurvePoint:
    cost: float
    latency: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class Matched:
    """A rival's interpolated value and whether it lay inside the rival's measured range."""

    value: float
    reached: bool


def pareto_envelope(points: Iterable[CurvePoint]) -> list[CurvePoint]:
    """Points not dominated on (cost, latency), sorted by rising cost and falling latency."""
    finite = [p for p in points if math.isfinite(p.cost) and math.isfinite(p.latency)]
    if not finite:
        raise ValueError("a curve needs at least one finite point")
    finite.sort(key=lambda p: (p.cost, p.latency))
    envelope: list[CurvePoint] = []
    for p in finite:
        if not envelope or p.latency < envelope[-1].latency:
            envelope.append(p)
    return envelope


def _interp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    if x1 == x0:
        return min(y0, y1)
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def latency_at_cost(curve: Sequence[CurvePoint], cost: float) -> Matched:
    """The rival's latency at ``cost`` on its envelope (see the module docstring)."""
    env = pareto_envelope(curve)
    if cost < env[0].cost:
        return Matched(env[0].latency, False)
    if cost > env[-1].cost:
        return Matched(env[-1].latency, False)
    if cost == env[-1].cost:
        return Matched(env[-1].latency, True)
    for a, b in zip(env, env[1:], strict=False):
        if a.cost <= cost <= b.cost:
            return Matched(_interp(cost, a.cost, b.cost, a.latency, b.latency), True)
    raise AssertionError("unreachable: cost lies inside the envelope's range")


def cost_at_latency(curve: Sequence[CurvePoint], latency: float) -> Matched:
    """The cost the rival needs to reach ``latency`` (see the module docstring)."""
    env = pareto_envelope(curve)
    if latency > env[0].latency:
        return Matched(env[0].cost, False)
    if latency == env[0].latency:
        return Matched(env[0].cost, True)
    if latency < env[-1].latency:
        return Matched(env[-1].cost, False)
    for a, b in zip(env, env[1:], strict=False):
        if b.latency <= latency <= a.latency:
            # Latency falls as cost rises along the envelope.
            return Matched(_interp(latency, a.latency, b.latency, a.cost, b.cost), True)
    raise AssertionError("unreachable: latency lies inside the envelope's range")


def reduction_pct(rival: float, ours: float) -> float:
    """How much lower ours is than the rival's, in percent of the rival's value."""
    if rival <= 0:
        return 0.0
    return 100.0 * (rival - ours) / rival


def latency_reduction_at_matched_cost(
    rival: Sequence[CurvePoint], ours: CurvePoint
) -> tuple[float, Matched]:
    matched = latency_at_cost(rival, ours.cost)
    return reduction_pct(matched.value, ours.latency), matched


def cost_reduction_at_matched_latency(
    rival: Sequence[CurvePoint], ours: CurvePoint
) -> tuple[float, Matched]:
    matched = cost_at_latency(rival, ours.latency)
    return reduction_pct(matched.value, ours.cost), matched

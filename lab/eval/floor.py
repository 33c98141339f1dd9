"""The floor: the cheapest GPU schedule that a policy could possibly run on a trace.

Two exact offline bounds, both computed from the whole future trace and a capacity K
(active sessions per GPU, from the latency profile):

``floor_gpu_seconds`` -- the integral over time of ``ceil(active(t) / K)``.

    Proof that it is a lower bound.  Let a(t) be the number of active sessions at time t
    (piecewise constant between trace events).  Any policy that gives every active session a
    slot on a ready GPU, with at most K active sessions per GPU, has at least
    ``ceil(a(t) / K)`` ready GPUs at every instant t.  Its cost is the integral of the number
    of booting + ready + draining GPUs, each term non-negative, so it is at least the
    integral of the ready GPUs, hence at least the integral of ``ceil(a(t) / K)``.  Both
    sides are integrals of step functions over the same segments, so the bound is exact
    arithmetic, not an approximation.  It holds for any boot delay, any placement and any
    migration cost, because it charges nothing for them.

``floor_with_boot_gpu_seconds`` -- the same, but a GPU must be requested ``boot_delay_s``
before it serves and is paid for while booting (a GPU asked for before the trace starts is
free: the simulator does not charge for time before t0).

    It is the optimum of the linear program, over segments j of the demand step function,
    ``min sum_j len_j * x_j + sum_j c_j * s_j`` subject to ``x_j >= need_j``,
    ``s_j >= x_j - x_{j-1}``, ``s_j >= 0`` (``x_{-1} = 0``), where x_j is the number of ready
    GPUs on segment j, s_j the GPUs that became ready at its start and
    ``c_j = min(boot_delay, t_j - t0)`` the booting time each of them was paid for.  Every
    real schedule gives a feasible integer point of that program with a cost no higher than
    its own (it may also keep GPUs booting or draining longer), so the LP optimum is a lower
    bound.  The program is a network (interval) matrix, so its optimum is integral and equals
    the per-level closed form we compute below: for level i (the i-th GPU, needed while
    need >= i), each gap between two runs of that level is either bridged (pay the gap) or
    the GPU is released and re-booted (pay c at the restart), whichever is cheaper.  A test
    checks the closed form against HiGHS on random demand.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DemandStep",
    "active_steps",
    "floor_gpu_seconds",
    "floor_with_boot_gpu_seconds",
    "floor_with_boot_lp",
    "gpu_need_steps",
]

_ACTIVE_KINDS = {"arrive", "active"}
_INACTIVE_KINDS = {"idle", "depart"}


@dataclass(frozen=True, slots=True)
class DemandStep:
    """Active sessions ``active`` on the half-open interval ``[t, t_end)``."""

    t: float
    t_end: float
    active: int


def _kind_name(kind: Any) -> str:
    """Accept the trace's strings and the core's ``EventKind`` enum alike."""
    name = kind if isinstance(kind, str) else getattr(kind, "value", None)
    if not isinstance(name, str):
        name = getattr(kind, "name", str(kind))
    return name.lower()


def _row_fields(row: Any) -> tuple[float, str, str]:
    if isinstance(row, tuple | list):
        t, session_id, kind = row[0], row[1], row[2]
    else:
        t = row.t
        session_id = row.session_id
        kind = getattr(row, "event", None) or row.kind
    return float(t), str(session_id), _kind_name(kind)


def active_steps(rows: Iterable[Any], *, t_end: float | None = None) -> list[DemandStep]:
    """Active-session count as a step function of time, from trace rows.

    ``rows`` are ``(t, session_id, event)`` tuples or objects with ``t``, ``session_id`` and
    ``event``/``kind`` (the core's ``Event`` works; pool events are skipped).  The step
    function ends at ``t_end`` (default: the last event).  Events at one instant are applied
    together, so zero-length blips never count.
    """
    active: set[str] = set()
    steps: list[DemandStep] = []
    t_prev: float | None = None
    count_prev = 0
    for row in rows:
        t, session_id, kind = _row_fields(row)
        if kind not in _ACTIVE_KINDS and kind not in _INACTIVE_KINDS:
            continue
        if t_prev is not None and t < t_prev:
            raise ValueError(f"trace time goes backwards at t={t} (after t={t_prev})")
        if t_prev is not None and t > t_prev:
            steps.append(DemandStep(t_prev, t, count_prev))
        t_prev = t
        if kind in _ACTIVE_KINDS:
            active.add(session_id)
        else:
            active.discard(session_id)
        count_prev = len(active)
    if t_prev is not None:
        end = t_prev if t_end is None else t_end
        if end > t_prev:
            steps.append(DemandStep(t_prev, end, count_prev))
    return steps


def gpu_need_steps(steps: Sequence[DemandStep], capacity: int) -> list[DemandStep]:
    """Map active sessions to GPUs needed, ``ceil(active / capacity)``, merging equal runs."""
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    out: list[DemandStep] = []
    for step in steps:
        need = math.ceil(step.active / capacity)
        if out and out[-1].active == need and out[-1].t_end == step.t:
            out[-1] = DemandStep(out[-1].t, step.t_end, need)
        else:
            out.append(DemandStep(step.t, step.t_end, need))
    return out


def floor_gpu_seconds(steps: Sequence[DemandStep], capacity: int) -> float:
    """Integral of ``ceil(active(t) / capacity)``: a lower bound on any policy's cost."""
    return math.fsum((s.t_end - s.t) * math.ceil(s.active / capacity) for s in steps)


def floor_with_boot_gpu_seconds(
    steps: Sequence[DemandStep], capacity: int, boot_delay_s: float
) -> float:
    """The boot-aware floor (see the module docstring), by the per-level closed form."""
    need = gpu_need_steps(steps, capacity)
    if not need:
        return 0.0
    t0 = need[0].t
    total = floor_gpu_seconds(steps, capacity)
    for level in range(1, max(s.active for s in need) + 1):
        # Runs of segments where this level is needed, as (start, end) pairs.
        runs: list[tuple[float, float]] = []
        for s in need:
            if s.active >= level:
                if runs and runs[-1][1] == s.t:
                    runs[-1] = (runs[-1][0], s.t_end)
                else:
                    runs.append((s.t, s.t_end))
        for k, (start, _end) in enumerate(runs):
            boot_cost = min(boot_delay_s, start - t0)
            if k == 0:
                total += boot_cost
            else:
                gap = start - runs[k - 1][1]
                total += min(gap, boot_cost)
    return total


def floor_with_boot_lp(steps: Sequence[DemandStep], capacity: int, boot_delay_s: float) -> float:
    """The same bound solved as the LP with HiGHS (used to check the closed form)."""
    import highspy
    import numpy as np

    need = gpu_need_steps(steps, capacity)
    if not need:
        return 0.0
    t0 = need[0].t
    n = len(need)
    # highspy leaves the constructor unannotated; the solver's methods are typed.
    h = highspy.Highs()  # type: ignore[no-untyped-call]
    h.setOptionValue("output_flag", False)
    inf = highspy.kHighsInf
    # Columns: x_0..x_{n-1}, then s_0..s_{n-1}.
    costs = [s.t_end - s.t for s in need] + [min(boot_delay_s, s.t - t0) for s in need]
    lower = [float(s.active) for s in need] + [0.0] * n
    h.addVars(2 * n, np.array(lower), np.full(2 * n, inf))
    h.changeColsCost(2 * n, np.arange(2 * n, dtype=np.int32), np.array(costs))
    # s_j - x_j + x_{j-1} >= 0.
    for j in range(n):
        idx = [n + j, j] + ([j - 1] if j > 0 else [])
        val = [1.0, -1.0] + ([1.0] if j > 0 else [])
        h.addRow(0.0, inf, len(idx), np.array(idx, dtype=np.int32), np.array(val))
    h.run()
    return float(h.getInfo().objective_function_value)

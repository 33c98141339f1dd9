"""A steady load must not make the pool flap: six sessions that stay for 30 minutes, always
active or flipping between active and idle every few seconds, in the paced simulator with the
shipped tables (``docs/evaluation.md``, "Robustness")."""

from __future__ import annotations

import random
from typing import Any

import pytest

from lab.sim.simulator import simulate
from lab.sim.traceio import Trace, TraceEvent

H20 = "h20-longlive-1.3b-nvlink"
H200 = "h200-wan-1.3b-measured"
DURATION_S = 1800.0


def six_sessions(flip: bool) -> Trace:
    """Six sessions arriving in the first 6 s and staying to the end; with ``flip``, each
    alternates between active and idle after 3-8 s spells (seeded)."""
    rng = random.Random(3)
    events = []
    for i in range(6):
        sid = f"s{i}"
        events.append(TraceEvent(float(i), sid, "arrive"))
        t, active = float(i), True
        while flip:
            t += rng.uniform(3.0, 8.0)
            if t >= DURATION_S:
                break
            events.append(TraceEvent(round(t, 3), sid, "idle" if active else "active"))
            active = not active
    return Trace("six_" + ("flipping" if flip else "steady"), tuple(sorted(events)), DURATION_S)


@pytest.mark.parametrize(
    ("profile", "flip", "params"),
    [
        (H20, False, {}),
        (H20, True, {}),
        (H20, True, {"rho_hat": 0.7}),
        (H20, True, {"rho_hat": 0.95}),
        (H200, False, {"rho_hat": 0.95}),
        pytest.param(
            H200,
            False,
            {},
            marks=pytest.mark.xfail(
                strict=True,
                reason="six arrivals in 6 s read as a burst (H200 table levels 7-8): the pool "
                "grows from 5 to 6 GPUs, then shrinks to 3 (1.59 GPU-h, 100%)",
            ),
        ),
        pytest.param(
            H200,
            True,
            {},
            marks=pytest.mark.xfail(
                strict=True,
                reason="K = 2: flips move the pool; 34 scale-outs, 36 scale-ins, 97.5% of "
                "periods where a static 3-GPU pool serves 100%",
            ),
        ),
    ],
)
def test_six_steady_sessions_do_not_move_the_pool(
    profile: str, flip: bool, params: dict[str, Any]
) -> None:
    result = simulate(six_sessions(flip), "turboserve", profile=profile, **params)
    assert (result.scale_out_events, result.scale_in_events) == (0, 0)
    assert result.stall_adjusted_attainment == pytest.approx(1.0)


def test_a_scale_in_window_of_one_boot_holds_flipping_sessions() -> None:
    """What stops the flapping at K = 2 (not shipped: with the H20 table it costs the churny
    traces more than it saves): with the window, a GPU booting for one flip to active is not
    cancelled by the next flip to idle."""
    trace = six_sessions(True)
    without = simulate(trace, "turboserve", profile=H200, rho_hat=0.7)
    held = simulate(trace, "turboserve", profile=H200, rho_hat=0.7, scale_in_delay_s=30.0)
    assert without.scale_out_events > 10 * held.scale_out_events
    assert held.stall_adjusted_attainment == pytest.approx(1.0)
    assert without.stall_adjusted_attainment < 0.9

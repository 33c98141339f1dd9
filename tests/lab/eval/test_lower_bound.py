"""oracle_is_lower_bound: on every built-in trace the floor never exceeds a policy's cost.

Two bounds are checked on every run (see lab/eval/floor.py for the proofs):
the run's own served-slot floor always, and the trace's floor (and boot-aware floor) for
every run that gave every active session a slot at all times.  Autoscaling policies are
also held to the trace's floor outright, which is the paper-facing claim.
"""

from __future__ import annotations

import pytest

from lab.eval.analysis import TraceFloors
from lab.eval.runs import RunSpec, execute
from lab.sim.synth import BUILTIN_NAMES, builtin_trace

BOOT_S = 30.0
K = 12  # the default profile's capacity; checked below


@pytest.fixture(scope="module")
def capacity():
    from shared.profile import load_profile

    k = load_profile().capacity
    assert k == K
    return k


@pytest.mark.slow  # every policy over every shipped trace: a few seconds to a minute each
@pytest.mark.parametrize("trace_name", BUILTIN_NAMES)
def test_no_policy_costs_less_than_the_floor(trace_name, capacity):
    trace = builtin_trace(trace_name)
    floors = TraceFloors(trace, capacity, (BOOT_S,))
    assert floors.floor_h > 0
    peak_need = -(-floors.peak_active // capacity)
    specs = [
        RunSpec(trace_name, "turboserve", "turboserve", (("initial_gpus", 2),)),
        RunSpec(trace_name, "hpa", "hpa", (("initial_gpus", 2),)),
        RunSpec(trace_name, "clairvoyant", "clairvoyant", (("initial_gpus", 2), ("future", True))),
        RunSpec(trace_name, "least_loaded", "least_loaded", (("gpus", peak_need),)),
    ]
    for spec in specs:
        run = execute(spec)
        assert run.cost_gpu_h >= run.served_floor_gpu_h - 1e-9, spec
        if run.unserved_session_s == 0.0:
            assert run.cost_gpu_h >= floors.floor_h - 1e-9, spec
            assert run.cost_gpu_h >= floors.with_boot_h[BOOT_S] - 1e-9, spec
        if spec.policy != "least_loaded":
            assert run.cost_gpu_h >= floors.floor_h, spec

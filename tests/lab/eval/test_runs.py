"""The evaluation's run wrapper must not change what it measures."""

from __future__ import annotations

from lab.eval.runs import RunSpec, execute, prime_trace_cache
from lab.sim.simulator import make_policy, simulate
from lab.sim.synth import generate, spec
from shared.profile import load_profile


def test_a_recorded_run_equals_a_direct_run():
    trace = generate(spec("bursty", seed=11, duration_s=300.0), name="short_bursty_11")
    prime_trace_cache({"short_bursty_11": trace})
    profile = load_profile()
    for policy, params in (("turboserve", {"initial_gpus": 3}), ("least_loaded", {"gpus": 4})):
        recorded = execute(RunSpec("short_bursty_11", policy, policy, tuple(params.items())))
        # The same policy, built as any caller builds it (with the shipped rho_hat table).
        direct = simulate(
            trace,
            make_policy(policy, profile, boot_delay_s=30.0, **params),
            profile,
            boot_delay_s=30.0,
        )
        assert recorded.cost_gpu_h * 3600 == direct.cost_gpu_seconds
        assert recorded.p99_ms == direct.latency()["p99"]
        assert recorded.migrations == direct.migrations
        assert recorded.chunks == direct.chunks
        assert recorded.cost_gpu_h >= recorded.served_floor_gpu_h

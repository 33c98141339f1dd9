"""Which runs the evaluation makes on one trace: the sweeps behind every curve and figure.

Curves (cost against p99 per-chunk latency, and cost against the stall-adjusted attainment):

* the paper's static baselines ``round_robin``, ``least_loaded``, ``memory_aware`` over GPU
  counts spanning 0.4x to 1.5x the count the trace's peak needs at capacity K;
* ``turboserve`` over fixed rho_hat values, plus one run with the adaptive table (ours);
* rivals: ``least_loaded_autoscale`` (least-loaded placement with a conventional threshold
  autoscaler) over its scale-out threshold, set to the same values as rho_hat, plus its
  default; ``hpa`` over utilisation targets;
* ablations: ``no_migration`` (our autoscaler and placement, no migration) over the same
  rho_hat values and adaptive; ``no_autoscale`` (migration, static pool) over GPU counts;
* oracle: ``clairvoyant`` over the same rho_hat values and adaptive;
* ``turboserve_predictive`` over the same rho_hat values and adaptive;
* the quality budget: ``turboserve_q`` (turboserve with a floor of denoising steps) over the
  same rho_hat values and adaptive;
* sensitivity: boot delay 0 / 30 / 120 s (turboserve and clairvoyant, adaptive), and the PCIe
  profile (turboserve, adaptive; no_migration is unaffected by the interconnect).

Every autoscaling policy starts with the same warm pool, sized for the demand of the first
boot delay at rho_hat 0.7 (the paper's clusters are running when its traces start; a cold
start would charge every policy the same boot lag and blur the comparison).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lab.eval.runs import DEFAULT_PROFILE, RunSpec
from lab.sim.simulator import warm_pool

__all__ = ["PlanConfig", "TraceFacts", "plan_trace"]

PCIE_PROFILE = "h20-longlive-1.3b-pcie"
STATIC_BASELINES = ("round_robin", "least_loaded", "memory_aware")


@dataclass(frozen=True, slots=True)
class PlanConfig:
    rho_hats: tuple[float, ...]
    hpa_targets: tuple[float, ...]
    static_factors: tuple[float, ...]
    no_autoscale_factors: tuple[float, ...] | None = None  # None: the static factors
    predictive_sweep: bool = True  # sweep rho_hat for the predictive scaler too
    boot_sweep: bool = True  # sweep rho_hat at the other boot delays too (matched oracle gap)
    boot_delays: tuple[float, ...] = (0.0, 30.0, 120.0)
    boot_delay_s: float = 30.0
    profile: str = DEFAULT_PROFILE
    pcie_profile: str = PCIE_PROFILE
    sensitivity: bool = True  # the boot-delay and interconnect sweeps
    every_static_count: bool = True  # every GPU count between the static factors' ends

    def for_profile(self, profile: str, *, main: bool) -> PlanConfig:
        """The plan for ``profile``. Only the ``main`` plan (the first profile at scale 1) runs
        the sensitivity sweeps and every static GPU count; the others sweep static pools at
        the factors' counts and every count near the knee only (many GPUs: a GPU that holds
        few sessions, or traces at a larger scale)."""
        from dataclasses import replace

        if main:
            return replace(self, profile=profile)
        return replace(
            self,
            profile=profile,
            sensitivity=False,
            boot_sweep=False,
            boot_delays=(self.boot_delay_s,),
            every_static_count=False,
        )

    @classmethod
    def full(cls) -> PlanConfig:
        return cls(
            rho_hats=(0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95),
            hpa_targets=(0.5, 0.6, 0.7, 0.8, 0.9),
            static_factors=(0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5),
        )

    @classmethod
    def quick(cls) -> PlanConfig:
        return cls(
            rho_hats=(0.55, 0.95),
            hpa_targets=(0.7, 0.9),
            static_factors=(0.6, 0.8, 1.0),
            no_autoscale_factors=(0.8, 1.0),
            predictive_sweep=False,
            boot_sweep=False,
        )


@dataclass(frozen=True, slots=True)
class TraceFacts:
    key: str  # what ``load_trace`` takes: a built-in name or a path
    name: str
    peak_active: int
    initial_active: int  # most active sessions during the first boot delay (>= 10 s)
    capacity: int


def _initial_gpus(facts: TraceFacts) -> int:
    """The warm pool ``simulate`` gives autoscalers by default (``warm_start_gpus``)."""
    return warm_pool(facts.initial_active, facts.capacity)


def plan_trace(facts: TraceFacts, cfg: PlanConfig, *, detail: bool = False) -> list[RunSpec]:
    """Every run for one trace; ``detail`` keeps latencies and timelines for the plots."""
    specs: list[RunSpec] = []
    init = ("initial_gpus", _initial_gpus(facts))

    def add(
        policy: str,
        curve: str,
        params: tuple[tuple[str, Any], ...] = (),
        *,
        profile: str | None = None,
        boot: float | None = None,
        keep: bool = False,
    ) -> None:
        specs.append(
            RunSpec(
                trace=facts.key,
                policy=policy,
                curve=curve,
                params=tuple(params),
                profile=profile or cfg.profile,
                boot_delay_s=cfg.boot_delay_s if boot is None else boot,
                detail=keep and detail,
            )
        )

    peak_need = max(1, math.ceil(facts.peak_active / facts.capacity))

    def counts(factors: tuple[float, ...]) -> list[int]:
        return sorted({max(1, round(peak_need * f)) for f in factors})

    def every_count(factors: tuple[float, ...]) -> list[int]:
        # A static curve is read by linear interpolation between its points, and p99 against
        # GPUs is convex and steep near the knee: a missing count in between would overstate
        # the rival's latency at matched cost. Static runs are cheap, so run every count
        # (with a small K the counts are many: then every count near the knee only).
        grid = counts(factors)
        if cfg.every_static_count:
            return list(range(grid[0], grid[-1] + 1))
        knee = counts(tuple(f for f in factors if 0.6 <= f <= 1.1))
        return sorted(set(grid) | set(range(knee[0], knee[-1] + 1, max(1, peak_need // 20))))

    for policy in STATIC_BASELINES:
        for n in every_count(cfg.static_factors):
            add(policy, policy, (("gpus", n),), keep=True)  # the plot picks matched cost
    for n in counts(cfg.no_autoscale_factors or cfg.static_factors):
        add("no_autoscale", "no_autoscale", (("gpus", n),))

    autoscalers = (
        "turboserve",
        "no_migration",
        "least_loaded_autoscale",
        "clairvoyant",
        "turboserve_predictive",
        "turboserve_q",
    )
    for policy in autoscalers:
        extra = (("future", True),) if policy == "clairvoyant" else ()
        add(policy, policy, (init, *extra), keep=True)  # adaptive table
        if policy == "turboserve_predictive" and not cfg.predictive_sweep:
            continue
        for rho in cfg.rho_hats:
            add(policy, policy, (init, ("rho_hat", rho), *extra))
    for target in cfg.hpa_targets:
        add("hpa", "hpa", (init, ("target", target)), keep=(target == 0.7))

    if not cfg.sensitivity:
        return specs
    for boot in cfg.boot_delays:
        if boot == cfg.boot_delay_s:
            continue  # the main runs above
        for fixed_rho in (None, *(cfg.rho_hats if cfg.boot_sweep else ())):
            fixed: tuple[tuple[str, Any], ...] = (
                () if fixed_rho is None else (("rho_hat", fixed_rho),)
            )
            add("turboserve", f"sens_boot_{boot:g}", (init, *fixed), boot=boot)
            add(
                "clairvoyant",
                f"sens_boot_{boot:g}_clairvoyant",
                (init, *fixed, ("future", True)),
                boot=boot,
            )
    # Without migration the PCIe profile changes nothing (same chunk table), so the
    # no-migration side of this comparison reuses the main no_migration run.
    add("turboserve", "sens_pcie", (init,), profile=cfg.pcie_profile)
    return specs

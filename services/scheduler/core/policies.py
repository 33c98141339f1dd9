"""Policies by name: one interface, one registry, the built-in policies.

A policy keeps its own view of the cluster, applies its own decisions to it immediately, and
returns them from ``step``; the environment (simulator or live service) carries them out and
reports pool events back. ``view`` exposes GPUs, placement and per-GPU active counts.

Built-ins (all are :class:`~services.scheduler.core.loop.Controller` with switches):

============== ============ ========= ========= ===============================================
name           placement    migration autoscale parameters
============== ============ ========= ========= ===============================================
turboserve     least growth yes       yes       rho_hat, delta, boot_delay_s, eta,
                                                initial_gpus, gpu_kind (+ min_gpus, max_gpus,
                                                rho_table, scale_in_delay_s,
                                                warmup_s, idle_reserve)
no_migration   least growth no        yes       same as turboserve
no_autoscale   least growth yes       no        gpus (static count), eta, gpu_kind, ...
round_robin    round robin  no        no        gpus, gpu_kind
least_loaded   least loaded no        no        gpus, gpu_kind
memory_aware   best fit     no        no        gpus, gpu_kind
============== ============ ========= ========= ===============================================

Static policies default to ``gpus = 16`` (the paper's H20 cluster). For autoscaling policies
``gpus`` is accepted as another name for ``initial_gpus``. Every policy accepts
``boot_delay_s`` and ``gpu_kind`` so an environment can pass them uniformly; an unknown
parameter is a ``TypeError`` that names it and the accepted ones.

Other modules add policies with :func:`register_policy`; ``extra_policies`` (the evaluation's
HPA-style, clairvoyant and predictive policies) is imported at the bottom when present.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from services.scheduler.core.cluster import ClusterView
from services.scheduler.core.loop import Controller
from services.scheduler.core.placement import (
    BestFit,
    LeastLatencyGrowth,
    RoundRobin,
    SoonestFirstChunk,
)
from services.scheduler.core.profile import LatencyProfile, load_profile
from services.scheduler.core.types import Decision, Event

DEFAULT_STATIC_GPUS = 16


@runtime_checkable
class Policy(Protocol):
    name: str

    def step(self, event: Event) -> list[Decision]: ...

    @property
    def view(self) -> ClusterView: ...


PolicyFactory = Callable[..., Policy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``get_policy(name, profile, **params)`` call ``factory(profile, **params)``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    _REGISTRY[name] = factory


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, profile: LatencyProfile | str | Path | None = None, **params: Any) -> Policy:
    """A fresh policy object. ``profile`` may be a profile, a shipped name or a path (None: the
    default profile)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown policy {name!r}; available: {', '.join(available_policies())}"
        ) from None
    if not isinstance(profile, LatencyProfile):
        profile = load_profile() if profile is None else load_profile(profile)
    return factory(profile, **params)


# ---- built-ins ------------------------------------------------------------------------------

_AUTOSCALING_PARAMS = frozenset({
    "rho_hat", "delta", "boot_delay_s", "eta", "initial_gpus", "gpu_kind",
    "min_gpus", "max_gpus", "rho_table", "gpus", "t0", "scale_in_delay_s", "warmup_s",
    "idle_reserve",
})
_NO_AUTOSCALE_PARAMS = frozenset({"gpus", "eta", "gpu_kind", "boot_delay_s", "t0"})
_STATIC_PARAMS = frozenset({"gpus", "gpu_kind", "boot_delay_s", "t0"})


def _check(name: str, params: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise TypeError(
            f"policy {name!r} does not take {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}"
        )


def _autoscaling(name: str, migrate: bool) -> PolicyFactory:
    def factory(profile: LatencyProfile, **params: Any) -> Controller:
        _check(name, params, _AUTOSCALING_PARAMS)
        if "gpus" in params:
            if "initial_gpus" in params:
                raise TypeError(f"policy {name!r}: give gpus or initial_gpus, not both")
            params["initial_gpus"] = params.pop("gpus")
        return Controller(profile, name=name, migrate=migrate, autoscale=True,
                          chooser=SoonestFirstChunk(), **params)

    return factory


def _no_autoscale(profile: LatencyProfile, **params: Any) -> Controller:
    _check("no_autoscale", params, _NO_AUTOSCALE_PARAMS)
    gpus = params.pop("gpus", DEFAULT_STATIC_GPUS)
    return Controller(
        profile, name="no_autoscale", migrate=True, autoscale=False, initial_gpus=gpus,
        chooser=SoonestFirstChunk(), **params,
    )


def _static(name: str, chooser: Callable[[], Any]) -> PolicyFactory:
    def factory(profile: LatencyProfile, **params: Any) -> Controller:
        _check(name, params, _STATIC_PARAMS)
        gpus = params.pop("gpus", DEFAULT_STATIC_GPUS)
        return Controller(
            profile, name=name, migrate=False, autoscale=False, initial_gpus=gpus,
            chooser=chooser(), rho_hat=1.0, **params,
        )

    return factory


register_policy("turboserve", _autoscaling("turboserve", migrate=True))
register_policy("no_migration", _autoscaling("no_migration", migrate=False))
register_policy("no_autoscale", _no_autoscale)
register_policy("round_robin", _static("round_robin", RoundRobin))
register_policy("least_loaded", _static("least_loaded", LeastLatencyGrowth))
register_policy("memory_aware", _static("memory_aware", BestFit))

try:
    import services.scheduler.core.extra_policies  # noqa: F401  (registers itself)
except ModuleNotFoundError as exc:
    if exc.name != "services.scheduler.core.extra_policies":
        raise

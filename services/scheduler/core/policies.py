"""Policies by name: one interface, one registry, the built-in policies.

A policy keeps its own view of the cluster, applies its own decisions to it immediately, and
returns them from ``step``; the environment (simulator or live service) carries them out and
reports pool events back. ``view`` exposes GPUs, placement and per-GPU active counts.

``get_policy(name, profiles, **params)``: ``profiles`` is a :class:`LatencyProfile` or a
mapping GPU kind -> profile (values: the core reads no files; load them with
``services.scheduler.shipped``); ``params`` are :class:`ControllerConfig` fields (and a
policy's own, for the evaluation's extra policies).

Built-ins (all are :class:`~services.scheduler.core.loop.Controller` with switches):

============== ============ ========= ========= ===============================================
name           placement    migration autoscale parameters
============== ============ ========= ========= ===============================================
turboserve     soonest      yes       yes       rho_hat, delta, rho_table, idle_reserve,
               first chunk                      boot_delay_s, eta, initial_gpus, gpu_kind,
                                                min_gpus, max_gpus, scale_in_delay_s,
                                                peak_rho, peak_window_s, peak_surge_s,
                                                warmup_s, retry_backoff_s, t0
no_migration   soonest ...  no        yes       same as turboserve
no_autoscale   soonest ...  yes       no        gpus (static count), eta, gpu_kind, ...
round_robin    round robin  no        no        gpus, gpu_kind
least_loaded   least loaded no        no        gpus, gpu_kind
memory_aware   best fit     no        no        gpus, gpu_kind
============== ============ ========= ========= ===============================================

Static policies default to ``gpus = 16`` (the paper's H20 cluster). For autoscaling policies
``gpus`` is accepted as another name for ``initial_gpus``. Every policy accepts
``boot_delay_s`` and ``gpu_kind`` so an environment can pass them uniformly; an unknown
parameter is a ``TypeError`` that names it and the accepted ones.
Without ``rho_table`` (and without a fixed ``rho_hat``) the autoscalers use the fixed
``FALLBACK_RHO_HAT``; the shipped table is ``services.scheduler.shipped.load_rho_table()``.

Other modules add policies with :func:`register_policy`; ``extra_policies`` (the evaluation's
HPA-style, clairvoyant and predictive policies) is imported at the bottom when present.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from services.scheduler.core.cluster import ClusterView
from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller
from services.scheduler.core.types import Decision, Event
from shared.profile import LatencyProfile

DEFAULT_STATIC_GPUS = 16
Profiles = LatencyProfile | Mapping[str, LatencyProfile]


@runtime_checkable
class Policy(Protocol):
    name: str

    def step(self, event: Event) -> list[Decision]: ...

    @property
    def view(self) -> ClusterView: ...


PolicyFactory = Callable[..., Policy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``get_policy(name, profiles, **params)`` call ``factory(profiles, **params)``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    _REGISTRY[name] = factory


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, profiles: Profiles, **params: Any) -> Policy:
    """A fresh policy object on ``profiles`` (a profile, or GPU kind -> profile)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown policy {name!r}; available: {', '.join(available_policies())}"
        ) from None
    if not isinstance(profiles, LatencyProfile | Mapping):
        raise TypeError(f"policy {name!r}: profiles must be a LatencyProfile or a mapping of GPU "
                        f"kind to LatencyProfile (load files with services.scheduler.shipped), "
                        f"got {type(profiles).__name__}")
    return factory(profiles, **params)


# ---- built-ins ------------------------------------------------------------------------------

_AUTOSCALING_PARAMS = frozenset({
    "rho_hat", "delta", "boot_delay_s", "eta", "initial_gpus", "gpu_kind",
    "min_gpus", "max_gpus", "rho_table", "gpus", "t0", "scale_in_delay_s", "warmup_s",
    "idle_reserve", "retry_backoff_s", "gpu_id_prefix", "peak_rho", "peak_window_s",
    "peak_surge_s",
})
_NO_AUTOSCALE_PARAMS = frozenset({"gpus", "eta", "gpu_kind", "boot_delay_s", "t0",
                                  "retry_backoff_s", "gpu_id_prefix"})
_STATIC_PARAMS = frozenset({"gpus", "gpu_kind", "boot_delay_s", "t0", "gpu_id_prefix"})


def check_params(name: str, params: dict[str, Any], allowed: frozenset[str]) -> None:
    """Raise ``TypeError`` naming any parameter of ``params`` that policy ``name`` does not
    take, and listing those it does."""
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise TypeError(
            f"policy {name!r} does not take {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}"
        )


def gpus_alias(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``gpus`` as another name for ``initial_gpus`` (autoscaling policies)."""
    if "gpus" in params:
        if "initial_gpus" in params:
            raise TypeError(f"policy {name!r}: give gpus or initial_gpus, not both")
        params = dict(params)
        params["initial_gpus"] = params.pop("gpus")
    return params


def _autoscaling(name: str, migrate: bool) -> PolicyFactory:
    def factory(profiles: Profiles, **params: Any) -> Controller:
        check_params(name, params, _AUTOSCALING_PARAMS)
        params = gpus_alias(name, params)
        return Controller(profiles, ControllerConfig(
            name=name, migrate=migrate, autoscale=True, placement="soonest_first_chunk",
            **params))

    return factory


def _no_autoscale(profiles: Profiles, **params: Any) -> Controller:
    check_params("no_autoscale", params, _NO_AUTOSCALE_PARAMS)
    gpus = params.pop("gpus", DEFAULT_STATIC_GPUS)
    return Controller(profiles, ControllerConfig(
        name="no_autoscale", migrate=True, autoscale=False, initial_gpus=gpus,
        placement="soonest_first_chunk", **params))


def _static(name: str) -> PolicyFactory:
    def factory(profiles: Profiles, **params: Any) -> Controller:
        check_params(name, params, _STATIC_PARAMS)
        gpus = params.pop("gpus", DEFAULT_STATIC_GPUS)
        return Controller(profiles, ControllerConfig(
            name=name, migrate=False, autoscale=False, initial_gpus=gpus, placement=name,
            **params))

    return factory


register_policy("turboserve", _autoscaling("turboserve", migrate=True))
register_policy("no_migration", _autoscaling("no_migration", migrate=False))
register_policy("no_autoscale", _no_autoscale)
register_policy("round_robin", _static("round_robin"))
register_policy("least_loaded", _static("least_loaded"))
register_policy("memory_aware", _static("memory_aware"))

try:
    import services.scheduler.core.extra_policies  # noqa: F401  (registers itself)
except ModuleNotFoundError as exc:
    if exc.name != "services.scheduler.core.extra_policies":
        raise

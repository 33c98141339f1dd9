"""Policies by name: one interface, one registry, the built-in policies.

A policy keeps its own view of the cluster, applies its own decisions to it immediately, and
returns them from ``step``; the environment (simulator or live service) carries them out and
reports pool events back. :class:`Policy` lists everything an environment may call.

Each registered policy takes one frozen config (its :class:`PolicySpec` names the type):

* ``get_policy(name, profiles, config)`` builds it; ``config`` must be of the policy's type
  (None: its defaults). ``profiles`` is a :class:`LatencyProfile` or a mapping GPU kind ->
  profile (values: the core reads no files; load them with ``shared.profile`` and the rho table
  with ``services.scheduler.shipped``).
* ``policy_config(name, params)`` turns loose parameters (a command line's ``--param``, a
  sweep's settings) into that config: each key must be a field of it (or an alias a policy
  declares); an unknown one is a ``TypeError`` that names it and lists the accepted ones, a bad
  value a ``ValueError``.

Built-ins (all are :class:`~services.scheduler.core.loop.Controller` with switches):

============== ============ ========= ========= ================================================
name           placement    migration autoscale config
============== ============ ========= ========= ================================================
turboserve     soonest      yes       yes       :class:`ControllerConfig` (``gpus`` is another
               first chunk                      name for ``initial_gpus`` in loose parameters)
turboserve_q   soonest ...  yes       yes       same as turboserve, with the quality budget on:
                                                ``min_steps`` defaults to
                                                ``QUALITY_MIN_STEPS``; offline only (live:
                                                turboserve with ``min_steps`` set)
no_migration   soonest ...  no        yes       same as turboserve
no_autoscale   soonest ...  yes       no        :class:`NoAutoscaleConfig` (gpus, eta, ...)
round_robin    round robin  no        no        :class:`StaticConfig` (gpus, gpu_kind, ...)
least_loaded   least loaded no        no        :class:`StaticConfig`
memory_aware   best fit     no        no        :class:`StaticConfig`
============== ============ ========= ========= ================================================

The policy sets the switches of a :class:`ControllerConfig` it is given (``name``,
``placement``, ``migrate``, ``autoscale``); loose parameters may not name them. Static policies
default to ``gpus = 16`` (the paper's H20 cluster). Without ``rho_table`` (and without a fixed
``rho_hat``) the autoscalers use the fixed ``FALLBACK_RHO_HAT``; the shipped table is
``services.scheduler.shipped.load_rho_table()``.

Other modules add policies with :func:`register_policy`: the evaluation's rivals (HPA-style,
threshold, predictive, clairvoyant) are registered by ``services.scheduler.core.rivals`` when
it is imported. A policy that needs what only an offline run knows (the future) is registered
with ``live=False``; the scheduler service refuses it (``shared.policies.LIVE_POLICIES`` holds
the names of the live ones, for the settings' check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from services.scheduler.core.cluster import ClusterView
from services.scheduler.core.config import (
    DEFAULT_BOOT_DELAY_S,
    DEFAULT_ETA,
    DEFAULT_RETRY_BACKOFF_S,
    ControllerConfig,
)
from services.scheduler.core.loop import Controller
from services.scheduler.core.types import Decision, Event, RestoredGpu, RestoredSession
from shared.profile import LatencyProfile

DEFAULT_STATIC_GPUS = 16
# turboserve_q's floor of denoising steps unless given: 3 of a 4-step model's 4 (a chunk at 4/5
# of its time). Lower floors buy more room at more cost in quality (docs/evaluation.md).
QUALITY_MIN_STEPS = 3
Profiles = LatencyProfile | Mapping[str, LatencyProfile]

# The fields of a ControllerConfig that a policy sets itself.
SWITCHES = frozenset({"name", "placement", "migrate", "autoscale"})


@runtime_checkable
class Policy(Protocol):
    """What an environment calls on a policy. ``autoscales``: it asks for and gives back GPUs
    itself (False: it keeps the pool it is given). ``boot_delay_s``: what it was told a GPU
    takes to boot."""

    @property
    def name(self) -> str: ...

    @property
    def autoscales(self) -> bool: ...

    @property
    def boot_delay_s(self) -> float: ...

    @property
    def view(self) -> ClusterView: ...

    def step(self, event: Event) -> list[Decision]: ...

    def note_step(self, gpu_id: str, ends_at: float) -> None: ...

    def restore(
        self, gpus: Iterable[RestoredGpu], sessions: Iterable[RestoredSession], t: float
    ) -> None: ...

    def set_profile(self, kind: str, profile: LatencyProfile) -> None: ...

    def set_limits(self, min_gpus: int, max_gpus: int | None) -> None: ...

    def rho_max(self) -> float: ...

    def current_rho_hat(self, t: float) -> tuple[float, float]: ...


@dataclass(frozen=True, slots=True)
class StaticConfig:
    """A fixed pool: ``gpus`` READY GPUs of ``gpu_kind`` (None: the first profile's kind) from
    ``t0``, named ``<gpu_id_prefix>-NNNN``; ``boot_delay_s`` is what the environment's GPUs
    take to boot, ``retry_backoff_s`` how long a failed placement keeps a session off the
    GPU that failed."""

    gpus: int = DEFAULT_STATIC_GPUS
    gpu_kind: str | None = None
    boot_delay_s: float = DEFAULT_BOOT_DELAY_S
    t0: float = 0.0
    gpu_id_prefix: str | None = None
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S

    def controller(
        self, name: str, placement: str, migrate: bool, eta: float = DEFAULT_ETA
    ) -> ControllerConfig:
        """The controller's config for this pool (autoscaling off)."""
        return ControllerConfig(
            name=name,
            placement=placement,
            migrate=migrate,
            autoscale=False,
            initial_gpus=self.gpus,
            gpu_kind=self.gpu_kind,
            boot_delay_s=self.boot_delay_s,
            t0=self.t0,
            gpu_id_prefix=self.gpu_id_prefix,
            retry_backoff_s=self.retry_backoff_s,
            eta=eta,
        )


@dataclass(frozen=True, slots=True)
class NoAutoscaleConfig(StaticConfig):
    """A fixed pool that TurboServe places on and rebalances: ``eta`` is the weight of
    migration cost in the placement objective."""

    eta: float = DEFAULT_ETA


PolicyConfig = ControllerConfig | StaticConfig
# A rival's own config subclasses one of the two.
AnyConfig = TypeVar("AnyConfig", bound=PolicyConfig)


@dataclass(frozen=True, slots=True)
class PolicySpec(Generic[AnyConfig]):
    """A registered policy: its config type, how it is built from one, and what it is.

    ``autoscales``: it sizes the pool itself (the live service gives it the provisioner's
    limits), else it keeps the pool it is given. ``live``: the live scheduler may run it
    (False: it needs what only an offline run knows, e.g. the trace's future).
    ``aliases``: other names for config fields in loose parameters (old name -> field).
    ``quality_budget``: it may lower a GPU's denoising steps (it takes ``min_steps``); the
    rivals never do, though their configs extend :class:`ControllerConfig`."""

    name: str
    config_type: type[AnyConfig]
    build: Callable[[Profiles, AnyConfig], Policy]
    autoscales: bool
    live: bool = True
    aliases: Mapping[str, str] = field(default_factory=dict)
    quality_budget: bool = False

    @property
    def params(self) -> frozenset[str]:
        """The loose parameter names this policy takes."""
        fields = {f.name for f in dataclasses.fields(self.config_type)}
        if issubclass(self.config_type, ControllerConfig):
            fields -= SWITCHES
            if not self.quality_budget:
                fields.discard("min_steps")
        return frozenset(fields | set(self.aliases))

    def config(self, params: Mapping[str, object]) -> AnyConfig:
        """The config from loose parameters: ``TypeError`` for a name it does not take (or a
        field given under two names), ``ValueError`` for a value out of range."""
        accepted = self.params
        unknown = sorted(set(params) - accepted)
        if unknown:
            raise TypeError(
                f"policy {self.name!r} does not take {', '.join(unknown)}; "
                f"it takes {', '.join(sorted(accepted))}"
            )
        values: dict[str, Any] = dict(params)
        for alias, target in self.aliases.items():
            if alias in values:
                if target in values:
                    raise TypeError(f"policy {self.name!r}: give {alias} or {target}, not both")
                values[target] = values.pop(alias)
        if issubclass(self.config_type, ControllerConfig):
            values["name"] = self.name
        return self.config_type(**values)


_REGISTRY: dict[str, PolicySpec[Any]] = {}


def register_policy(spec: PolicySpec[Any]) -> None:
    """Make ``get_policy(spec.name, ...)`` build with ``spec``."""
    if not spec.name or not isinstance(spec.name, str):
        raise ValueError(f"policy name must be a non-empty string, got {spec.name!r}")
    _REGISTRY[spec.name] = spec


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def live_policies() -> list[str]:
    """The registered policies the live scheduler may run."""
    return sorted(name for name, spec in _REGISTRY.items() if spec.live)


def policy_spec(name: str) -> PolicySpec[Any]:
    """The registered policy ``name`` (``KeyError`` listing the known ones)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown policy {name!r}; available: {', '.join(available_policies())}"
        ) from None


def policy_config(name: str, params: Mapping[str, object]) -> PolicyConfig:
    """Policy ``name``'s config from loose parameters (see :meth:`PolicySpec.config`)."""
    config: PolicyConfig = policy_spec(name).config(params)
    return config


def get_policy(name: str, profiles: Profiles, config: PolicyConfig | None = None) -> Policy:
    """A fresh policy object on ``profiles`` (a profile, or GPU kind -> profile), set by
    ``config`` (of the policy's own config type; None: its defaults)."""
    spec = policy_spec(name)
    if not isinstance(profiles, LatencyProfile | Mapping):
        raise TypeError(
            f"policy {name!r}: profiles must be a LatencyProfile or a mapping of GPU "
            f"kind to LatencyProfile (load files with shared.profile), "
            f"got {type(profiles).__name__}"
        )
    if config is None:
        config = spec.config({})
    elif type(config) is not spec.config_type:
        raise TypeError(
            f"policy {name!r} takes a {spec.config_type.__name__}, got {type(config).__name__}"
        )
    return spec.build(profiles, config)


# ---- built-ins ------------------------------------------------------------------------------


def _autoscaling(
    name: str, migrate: bool, min_steps: int | None = None, live: bool = True
) -> PolicySpec[ControllerConfig]:
    def build(profiles: Profiles, config: ControllerConfig) -> Policy:
        if min_steps is not None and config.min_steps is None:
            config = dataclasses.replace(config, min_steps=min_steps)
        return Controller(
            profiles,
            dataclasses.replace(
                config, name=name, migrate=migrate, autoscale=True, placement="soonest_first_chunk"
            ),
        )

    return PolicySpec(
        name,
        ControllerConfig,
        build,
        autoscales=True,
        live=live,
        aliases={"gpus": "initial_gpus"},
        quality_budget=True,
    )


def _no_autoscale(profiles: Profiles, config: NoAutoscaleConfig) -> Policy:
    return Controller(
        profiles,
        config.controller("no_autoscale", "soonest_first_chunk", migrate=True, eta=config.eta),
    )


def _static(name: str) -> PolicySpec[StaticConfig]:
    def build(profiles: Profiles, config: StaticConfig) -> Policy:
        return Controller(profiles, config.controller(name, placement=name, migrate=False))

    return PolicySpec(name, StaticConfig, build, autoscales=False)


register_policy(_autoscaling("turboserve", migrate=True))
# Offline only: the live scheduler runs turboserve with TURBOSERVE_MIN_STEPS for the budget.
register_policy(_autoscaling("turboserve_q", migrate=True, min_steps=QUALITY_MIN_STEPS, live=False))
register_policy(_autoscaling("no_migration", migrate=False))
register_policy(PolicySpec("no_autoscale", NoAutoscaleConfig, _no_autoscale, autoscales=False))
register_policy(_static("round_robin"))
register_policy(_static("least_loaded"))
register_policy(_static("memory_aware"))

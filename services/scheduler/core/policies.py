"""Policies by name: one interface, the built-in policies, and the one list of the policies the
live scheduler may run.

A policy keeps its own view of the cluster, applies its own decisions to it immediately, and
returns them from ``step``; the environment (simulator or live service) carries them out and
reports pool events back. :class:`Policy` lists everything an environment may call.

:data:`LIVE_POLICIES` is a :class:`Policies`: a fixed mapping of name -> :class:`PolicySpec`,
written out here; nothing adds to it by being imported. Each spec takes one frozen config:

* ``LIVE_POLICIES.build(name, profiles, config)`` builds a policy; ``config`` must be of the
  policy's type (None: its defaults). ``profiles`` is a :class:`LatencyProfile` or a mapping GPU
  kind -> profile (values: the core reads no files; load them with ``shared.profile`` and the
  rho table with ``services.scheduler.shipped``).
* ``LIVE_POLICIES.config(name, params)`` turns loose parameters (a command line's ``--param``,
  a sweep's settings) into that config: each key must be a field of it (or an alias a policy
  declares); an unknown one is a ``TypeError`` that names it and lists the accepted ones, a bad
  value a ``ValueError``.

The live policies (all are :class:`~services.scheduler.core.loop.Controller` with switches, or
with another ``target_gpus``):

====================== ============ ========= ========= ========================================
name                   placement    migration autoscale config
====================== ============ ========= ========= ========================================
turboserve             soonest      yes       yes       :class:`ControllerConfig` (``gpus`` is
                       first chunk                      another name for ``initial_gpus`` in
                                                        loose parameters)
no_migration           soonest ...  no        yes       same as turboserve
no_autoscale           soonest ...  yes       no        :class:`NoAutoscaleConfig` (gpus, eta)
round_robin            round robin  no        no        :class:`StaticConfig` (gpus, gpu_kind)
least_loaded           least loaded no        no        :class:`StaticConfig`
memory_aware           best fit     no        no        :class:`StaticConfig`
hpa                    least loaded no        yes       ``rivals.HpaConfig``
least_loaded_autoscale least loaded no        yes       ``rivals.ThresholdConfig``
turboserve_predictive  least loaded yes       yes       ``rivals.PredictiveConfig``
turboserve_staffing    soonest ...  yes       yes       ``staffing.StaffingConfig`` (the pool
                                                        for the demand one boot ahead at a
                                                        stated ``confidence``)
====================== ============ ========= ========= ========================================

The policy sets the switches of a :class:`ControllerConfig` it is given (``name``,
``placement``, ``migrate``, ``autoscale``); loose parameters may not name them. Static policies
default to ``gpus = 16`` (the paper's H20 cluster). Without ``rho_table`` (and without a fixed
``rho_hat``) the autoscalers use the fixed ``FALLBACK_RHO_HAT``; the shipped table is
``services.scheduler.shipped.load_rho_table()``.

The names are ``shared.policies.LIVE_POLICIES``, the settings' check of ``TURBOSERVE_POLICY``
(the settings import no service): the list here is built on those names and stops the import
if it defines another set. The simulator knows more policies, those that run only offline (the
clairvoyant needs the future; ``turboserve_q`` is turboserve with the quality budget always
on): ``lab.sim.policies`` extends this list with them (:meth:`Policies.extended`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from services.scheduler.core.cluster import ClusterView
from services.scheduler.core.config import (
    DEFAULT_BOOT_DELAY_S,
    DEFAULT_ETA,
    DEFAULT_RETRY_BACKOFF_S,
    ControllerConfig,
)
from services.scheduler.core.loop import Controller, Profiles
from services.scheduler.core.rivals import (
    HpaConfig,
    HpaController,
    PredictiveConfig,
    PredictiveController,
    ThresholdConfig,
    ThresholdController,
)
from services.scheduler.core.staffing import StaffingConfig, StaffingController
from services.scheduler.core.types import Decision, Event, RestoredGpu, RestoredSession
from shared.policies import LIVE_POLICIES as LIVE_NAMES
from shared.profile import LatencyProfile

DEFAULT_STATIC_GPUS = 16

# Loose parameters of an autoscaler: ``gpus`` is another name for ``initial_gpus``.
GPUS_ALIAS: Mapping[str, str] = {"gpus": "initial_gpus"}
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

    def note_pass(self, gpu_id: str, ends_at: float) -> None: ...

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
    """A policy as a list holds it: its config type, how it is built from one, and what it is.

    ``autoscales``: it sizes the pool itself (the live service gives it the provisioner's
    limits), else it keeps the pool it is given. ``aliases``: other names for config fields in
    loose parameters (old name -> field). ``quality_budget``: it may lower a GPU's denoising steps (it takes ``min_steps``); the
    rivals never do, though their configs extend :class:`ControllerConfig`."""

    name: str
    config_type: type[AnyConfig]
    build: Callable[[Profiles, AnyConfig], Policy]
    autoscales: bool
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


class Policies(Mapping[str, PolicySpec[Any]]):
    """Policies by name: a fixed list of specs, iterated in name order. Looking up a name it
    does not hold is a ``KeyError`` that lists the ones it does."""

    def __init__(self, *specs: PolicySpec[Any]) -> None:
        by_name: dict[str, PolicySpec[Any]] = {}
        for spec in specs:
            if not spec.name or not isinstance(spec.name, str):
                raise ValueError(f"policy name must be a non-empty string, got {spec.name!r}")
            if spec.name in by_name:
                raise ValueError(f"policy {spec.name!r} is listed twice")
            by_name[spec.name] = spec
        self._specs = dict(sorted(by_name.items()))

    def __getitem__(self, name: str) -> PolicySpec[Any]:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"unknown policy {name!r}; available: {', '.join(self)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def extended(self, *specs: PolicySpec[Any]) -> Policies:
        """These policies and ``specs`` (a name listed twice is a ``ValueError``)."""
        return Policies(*self._specs.values(), *specs)

    def config(self, name: str, params: Mapping[str, object]) -> PolicyConfig:
        """Policy ``name``'s config from loose parameters (see :meth:`PolicySpec.config`)."""
        config: PolicyConfig = self[name].config(params)
        return config

    def build(self, name: str, profiles: Profiles, config: PolicyConfig | None = None) -> Policy:
        """A fresh policy object on ``profiles`` (a profile, or GPU kind -> profile), set by
        ``config`` (of the policy's own config type; None: its defaults)."""
        spec = self[name]
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


def autoscaling(
    name: str, migrate: bool, min_steps: int | None = None
) -> PolicySpec[ControllerConfig]:
    """TurboServe's autoscaling loop as policy ``name`` (``migrate``: with live migration;
    ``min_steps``: the quality budget's floor of denoising steps unless the config sets one)."""

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
        aliases=GPUS_ALIAS,
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


# The policies the live scheduler may run: this list and no other.
LIVE_POLICIES = Policies(
    autoscaling("turboserve", migrate=True),
    autoscaling("no_migration", migrate=False),
    PolicySpec("no_autoscale", NoAutoscaleConfig, _no_autoscale, autoscales=False),
    _static("round_robin"),
    _static("least_loaded"),
    _static("memory_aware"),
    PolicySpec(
        "hpa",
        HpaConfig,
        HpaController,
        autoscales=True,
        aliases={**GPUS_ALIAS, "rho_hat": "target"},
    ),
    PolicySpec(
        "least_loaded_autoscale",
        ThresholdConfig,
        ThresholdController,
        autoscales=True,
        aliases={**GPUS_ALIAS, "rho_hat": "high"},
    ),
    PolicySpec(
        "turboserve_predictive",
        PredictiveConfig,
        PredictiveController,
        autoscales=True,
        aliases=GPUS_ALIAS,
    ),
    PolicySpec(
        "turboserve_staffing",
        StaffingConfig,
        StaffingController,
        autoscales=True,
        aliases=GPUS_ALIAS,
        quality_budget=True,
    ),
)
if tuple(LIVE_POLICIES) != LIVE_NAMES:
    raise ImportError(
        f"the live policies are {', '.join(LIVE_POLICIES)}; shared.policies names "
        f"{', '.join(LIVE_NAMES)}"
    )

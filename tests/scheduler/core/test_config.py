"""ControllerConfig: one frozen value, validated once; the controller reads no files."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.scheduler.core.config import ControllerConfig
from services.scheduler.core.loop import Controller
from services.scheduler.core.types import Event, EventKind
from services.scheduler.shipped import load_rho_table
from shared.profile import load_profile

from .harness import build

PROFILE = load_profile()


def test_defaults_are_turboserve_and_frozen():
    config = ControllerConfig()
    assert (config.name, config.placement, config.migrate, config.autoscale) == (
        "turboserve",
        "soonest_first_chunk",
        True,
        True,
    )
    assert config.warmup == config.boot_delay_s == 30.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.eta = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("rho_hat", 1.5, "rho_hat must be in"),
        ("delta", -0.1, "delta must be >= 0"),
        ("eta", math.nan, "eta must be >= 0"),
        ("boot_delay_s", -1.0, "boot_delay_s must be >= 0"),
        ("retry_backoff_s", math.inf, "retry_backoff_s must be >= 0"),
        ("warmup_s", -1.0, "warmup_s must be >= 0"),
        ("idle_reserve", 2.0, "idle_reserve must be in"),
        ("peak_rho", 1.5, "peak_rho must be in"),
        ("peak_window_s", 0.0, "peak_window_s must be > 0"),
        ("peak_surge_s", -1.0, "peak_surge_s must be >= 0 and below peak_window_s"),
        ("peak_surge_s", 300.0, "peak_surge_s must be >= 0 and below peak_window_s"),
        ("initial_gpus", -1, "initial_gpus and min_gpus"),
        ("max_gpus", 0, "max_gpus must be >="),
        ("placement", "random", "unknown placement 'random'"),
        ("gpu_kind", "", "gpu_kind must be"),
        ("gpu_id_prefix", "a.b", "gpu_id_prefix must be"),
    ],
)
def test_bad_values_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        ControllerConfig(**{field: value})


def test_a_table_must_be_loaded_by_the_caller():
    with pytest.raises(TypeError, match="load_rho_table"):
        ControllerConfig(rho_table="services/scheduler/shipped/rho_table.json")  # type: ignore[arg-type]
    table = load_rho_table()
    assert table is not None
    controller = Controller(PROFILE, ControllerConfig(rho_table=table))
    assert controller.rho_table is table
    # A fixed rho_hat wins over the table, as before.
    assert Controller(PROFILE, ControllerConfig(rho_hat=0.6, rho_table=table)).rho_table is None


def test_controller_takes_a_config_and_profiles_by_kind():
    with pytest.raises(TypeError, match="ControllerConfig"):
        Controller(PROFILE, {"rho_hat": 0.7})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        Controller({}, ControllerConfig())
    controller = Controller({"H20": PROFILE}, ControllerConfig(initial_gpus=2))
    assert controller.view.gpus == {"h20-0000": "ready", "h20-0001": "ready"}
    out = controller.step(Event(0.0, EventKind.ARRIVE, "s0"))
    assert out[0].gpu_id in controller.view.gpus


def test_get_policy_params_are_config_fields():
    policy = build("turboserve", PROFILE, rho_hat=0.6, gpus=3, gpu_id_prefix="run7")
    assert isinstance(policy, Controller)
    assert policy.config.rho_hat == 0.6 and policy.config.initial_gpus == 3
    assert sorted(policy.view.gpus) == ["run7-0000", "run7-0001", "run7-0002"]
    with pytest.raises(TypeError, match="does not take placement"):
        build("turboserve", PROFILE, placement="round_robin")
    assert build("least_loaded", PROFILE).config.placement == "least_loaded"
    assert build("no_autoscale", PROFILE).config.autoscale is False

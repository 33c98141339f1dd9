"""TURBOSERVE_MIN_STEPS on the scheduler: a floor above the model's full count is refused when
the service is built, not when a leadership builds its core."""

from __future__ import annotations

import pytest

from services.scheduler.service import SchedulerService, live_policy
from shared.settings import SchedulerSettings, SettingsError


def test_floor_above_full_steps_is_a_settings_error() -> None:
    settings = SchedulerSettings.from_env({}, policy="turboserve", min_steps=9)
    with pytest.raises(SettingsError, match="TURBOSERVE_MIN_STEPS=9"):
        SchedulerService(settings)


def test_floor_within_full_steps_builds_the_core() -> None:
    settings = SchedulerSettings.from_env({}, policy="turboserve", min_steps=3)
    service = SchedulerService(settings)
    policy = live_policy(settings, service.profiles, service.default_kind, service.rho_table, 0, 4)
    assert policy.name == "turboserve"


def test_a_policy_without_the_budget_ignores_the_floor() -> None:
    settings = SchedulerSettings.from_env({}, policy="least_loaded", min_steps=9)
    SchedulerService(settings)  # ignored (with a warning at takeover), not refused

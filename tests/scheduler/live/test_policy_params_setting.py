"""TURBOSERVE_POLICY_PARAMS: the live policy's own parameters (an operator sets the staffing
policy's confidence, a service level), refused with a clear error when the policy does not
take them, when a value is out of range, or when the scheduler sets them itself."""

from __future__ import annotations

import pytest

from services.scheduler.service import SchedulerService, live_policy
from shared.settings import SchedulerSettings, SettingsError


def _built(env: dict[str, str]):
    settings = SchedulerSettings.from_env(env)
    service = SchedulerService(settings)
    return live_policy(settings, service.profiles, service.default_kind, service.rho_table, 0, 4)


def test_the_staffing_policy_runs_at_the_confidence_it_is_given() -> None:
    env = {"TURBOSERVE_POLICY": "turboserve_staffing"}
    default = _built(env)
    chosen = _built({**env, "TURBOSERVE_POLICY_PARAMS": '{"confidence": 0.9, "churn_slots": 0.25}'})
    assert default.config.confidence == 0.99 and default.config.churn_slots == 0.0
    assert chosen.config.confidence == 0.9 and chosen.config.churn_slots == 0.25
    # The service's own settings still hold beside them.
    assert chosen.config.max_gpus == 4 and chosen.config.floor_kept is True


@pytest.mark.parametrize(
    ("policy", "params", "match"),
    [
        ("turboserve_staffing", "confidence=0.9", "a JSON object"),
        ("turboserve_staffing", "[0.9]", "a JSON object"),
        ("turboserve_staffing", '{"confidense": 0.9}', "does not take confidense"),
        ("turboserve_staffing", '{"confidence": 1.5}', "TURBOSERVE_POLICY_PARAMS"),
        ("turboserve", '{"max_gpus": 64}', "set by the scheduler itself"),
        ("least_loaded", '{"min_steps": 2}', "set by the scheduler itself"),
    ],
)
def test_bad_policy_params_stop_the_service_with_what_is_wrong(policy, params, match) -> None:
    with pytest.raises(SettingsError, match=match):
        settings = SchedulerSettings.from_env(
            {"TURBOSERVE_POLICY": policy, "TURBOSERVE_POLICY_PARAMS": params}
        )
        SchedulerService(settings)

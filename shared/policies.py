"""The names of the scheduling policies the live scheduler may run (``TURBOSERVE_POLICY``).

Settings validation reads this list (the settings import no service). The policy core defines
the policies and builds its one list, ``services.scheduler.core.policies.LIVE_POLICIES``, on
these names: a name here without a policy there, or the other way round, stops its import. The
simulator knows more policies (``lab.sim.policies``: the clairvoyant one needs the future, so
it never runs live).
"""

from __future__ import annotations

LIVE_POLICIES = (
    "hpa",
    "least_loaded",
    "least_loaded_autoscale",
    "memory_aware",
    "no_autoscale",
    "no_migration",
    "round_robin",
    "turboserve",
    "turboserve_predictive",
    "turboserve_staffing",
)

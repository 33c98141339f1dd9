"""The names of the scheduling policies the live scheduler may run (``TURBOSERVE_POLICY``).

Settings validation reads this list; it cannot ask the scheduler's registry, which the
settings module does not import. The registry's test holds the two equal. The simulator and
the evaluation know more policies (the rivals; the clairvoyant one needs the future, so it
never runs live).
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
)

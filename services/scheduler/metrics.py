"""The scheduler's Prometheus metrics (served on its ops endpoint, ``/metrics``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.ops import metrics_registry


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else metrics_registry()
        r = self.registry
        self.decisions = Counter(
            "turboserve_scheduler_decisions", "Decisions by kind", ["kind"], registry=r
        )
        self.decision_seconds = Histogram(
            "turboserve_scheduler_decision_seconds",
            "Time of one controller step",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
            registry=r,
        )
        self.migrations = Counter(
            "turboserve_scheduler_migrations",
            "Migrations by outcome (ok, failed, refused, unreported)",
            ["outcome"],
            registry=r,
        )
        self.scale_events = Counter(
            "turboserve_scheduler_scale_events",
            "GPU requests (out) and releases (in)",
            ["direction"],
            registry=r,
        )
        self.rho_max = Gauge(
            "turboserve_scheduler_rho_max", "Load of the fullest GPU over K", registry=r
        )
        self.rho_hat = Gauge(
            "turboserve_scheduler_rho_hat", "Target utilisation in force", registry=r
        )
        self.gpus = Gauge("turboserve_scheduler_gpus", "GPUs by state", ["state"], registry=r)
        self.sessions = Gauge(
            "turboserve_scheduler_sessions", "Sessions by state", ["state"], registry=r
        )
        self.leader = Gauge(
            "turboserve_scheduler_leader", "1 while this scheduler leads", registry=r
        )

    def observe_view(self, status: dict[str, Any]) -> None:
        self.rho_max.set(float(status["rho_max"]))
        self.rho_hat.set(float(status["rho_hat"]))
        for state in ("ready", "booting", "draining", "releasing"):
            self.gpus.labels(state).set(float(status[state]))
        self.sessions.labels("active").set(float(status["active_sessions"]))
        self.sessions.labels("pending").set(float(status["pending"]))
        self.sessions.labels("idle").set(float(status["idle_sessions"]))

"""The provisioner's Prometheus metrics, in a registry of its own.

GPU-seconds and workers by state are read from the pool at scrape time (a collector), so they
are exact at every scrape; boots, boot time, departures and refusals are counted as they happen.
``kind`` is the GPU kind the workers emulate, or ``real``; ``emulated`` says which.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.provisioner.pool import Pool
from shared.ops import metrics_registry

BOOT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ProvisionerMetrics:
    def __init__(self, pool: Pool, backend: str) -> None:
        self.registry = metrics_registry()
        self.pool = pool
        self.backend = backend
        self.closed_gpu_seconds = 0.0  # of the workers gone since this process started
        r = self.registry
        labels = ["kind", "emulated"]
        self.boots = Counter(
            "turboserve_provisioner_boots",
            "Workers whose request was accepted (they boot)",
            labels,
            registry=r,
        )
        self.boot_seconds = Histogram(
            "turboserve_provisioner_boot_seconds",
            "From a worker's request to its first READY heartbeat",
            labels,
            buckets=BOOT_BUCKETS,
            registry=r,
        )
        self.gone = Counter(
            "turboserve_provisioner_gone",
            "Workers gone, by why (stopped, exited, boot_timeout, "
            "launch_failed, provisioner_stopped)",
            ["code"],
            registry=r,
        )
        self.refused = Counter(
            "turboserve_provisioner_refused",
            "Workers a command asked for and did not get, by command and code",
            ["command", "code"],
            registry=r,
        )
        self.callouts = Counter(
            "turboserve_provisioner_callouts",
            "The NATS server's auth callouts for worker connections, by outcome "
            "(admitted, refused, unavailable)",
            ["outcome"],
            registry=r,
        )
        self.enrolments = Counter(
            "turboserve_provisioner_enrolments",
            "Enrolments of workers it did not start, by outcome (enrolled, bad_request, "
            "worker_alive, launched_here, unknown_worker, unavailable)",
            ["outcome"],
            registry=r,
        )
        self.revoked = Counter(
            "turboserve_provisioner_enrolled_revoked",
            "Credentials of enrolled workers revoked because their heartbeats stopped",
            registry=r,
        )
        r.register(_PoolCollector(self))

    @property
    def kind_labels(self) -> tuple[str, str]:
        emulated = self.pool.emulated
        return (emulated or "real", "true" if emulated else "false")

    def booted(self) -> None:
        self.boots.labels(*self.kind_labels).inc()

    def ready(self, boot_s: float) -> None:
        self.boot_seconds.labels(*self.kind_labels).observe(boot_s)

    def departed(self, code: str, gpu_seconds: float) -> None:
        self.gone.labels(code).inc()
        self.closed_gpu_seconds += gpu_seconds

    def refusal(self, command: str, code: str) -> None:
        self.refused.labels(command, code).inc()


class _PoolCollector(Collector):
    def __init__(self, metrics: ProvisionerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        pool, now = self.m.pool, time.time()
        kind, emulated = self.m.kind_labels
        running = sum(max(0.0, now - s.requested_at) for s in pool.workers.values())
        seconds = CounterMetricFamily(
            "turboserve_provisioner_gpu_seconds",
            "GPU-seconds of the workers this provisioner "
            "ran, booting included (the shared figure is in Redis: shared.meter)",
            labels=["kind", "emulated"],
        )
        seconds.add_metric([kind, emulated], self.m.closed_gpu_seconds + running)
        yield seconds
        workers = GaugeMetricFamily(
            "turboserve_provisioner_workers",
            "Workers by state",
            labels=["state", "kind", "emulated"],
        )
        for state, n in pool.counts().items():
            workers.add_metric([state.value, kind, emulated], n)
        yield workers
        limits = GaugeMetricFamily(
            "turboserve_provisioner_pool_limit",
            "The pool's bounds (max: max_workers, or the host's GPUs when fewer)",
            labels=["bound", "backend"],
        )
        limits.add_metric(["min", self.m.backend], pool.min_workers)
        limits.add_metric(["max", self.m.backend], pool.max_size)
        yield limits

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return iter(())

"""The worker's Prometheus metrics (its ops endpoint, ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.ops import metrics_registry


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else metrics_registry()
        r = self.registry
        self.chunk_ms = Gauge(
            "turboserve_worker_chunk_ms",
            "Measured chunk time by batch size (moving average)",
            ["batch"],
            registry=r,
        )
        self.pass_ms = Gauge(
            "turboserve_worker_pass_ms",
            "Measured time of one batched pass by batch size",
            ["batch"],
            registry=r,
        )
        self.sessions = Gauge(
            "turboserve_worker_sessions", "Sessions by state", ["state"], registry=r
        )
        self.lateness = Histogram(
            "turboserve_worker_chunk_lateness_seconds",
            "How late each chunk was done against its due time (0 when on time)",
            buckets=(0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.handoffs = Counter(
            "turboserve_worker_handoffs",
            "Migrations this worker started, by outcome",
            ["outcome"],
            registry=r,
        )
        self.keeping_pace = Gauge(
            "turboserve_worker_keeping_pace",
            "0 while the real compute cannot keep an emulated GPU's pace",
            registry=r,
        )
        self.chunks_unpublished = Counter(
            "turboserve_chunks_unpublished",
            "Chunks made but not published (NATS refused or was away, or over the bound), "
            "each told to the session's viewers as an unpublished notice",
            registry=r,
        )
        self.input_frames = Counter(
            "turboserve_worker_input_frames",
            "Video sessions' input frames by outcome: put (in the session's buffer), stale "
            "(not after the last one), refused (no image), malformed, unknown_session, "
            "dropped_at_gateway (frames the gateway's relay dropped before it sent these)",
            ["outcome"],
            registry=r,
        )
        self.steps = Gauge(
            "turboserve_worker_steps",
            "Denoising steps per chunk in force: the model's full count, fewer under the "
            "quality budget",
            registry=r,
        )

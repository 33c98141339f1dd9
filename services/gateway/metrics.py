"""Prometheus metrics of one gateway, in a registry of its own (several apps in one process,
as in tests, never clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.gateway.chunkview import ChunkView
from services.gateway.store import Activity
from shared.states import SessionState

# Seconds a chunk was done after it was due (0 when on time).
LATENCY_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Transports whose client and lag-skip series exist (at 0) before their first client.
CLIENT_TRANSPORTS = ("sse", "ws")
INPUT_OUTCOMES = ("relayed", "dropped", "refused")


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sessions = Gauge(
            "turboserve_sessions", "Open sessions, by registry state", ["state"], registry=r
        )
        self.activity = Gauge(
            "turboserve_session_activity",
            "Open sessions, by activity: active, idle (no viewer), paused (by its client)",
            ["activity"],
            registry=r,
        )
        self.chunks = Counter(
            "turboserve_gateway_chunks",
            "Live chunks this gateway relayed (each once, however many clients watch)",
            registry=r,
        )
        self.chunk_latency = Histogram(
            "turboserve_chunk_latency_seconds",
            "How late a relayed chunk was done (done_at - due_at, 0 when on time)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.deadline_misses = Counter(
            "turboserve_deadline_misses", "Relayed chunks done after their due time", registry=r
        )
        self.clients = Gauge(
            "turboserve_stream_clients",
            "Clients attached to this gateway",
            ["transport"],
            registry=r,
        )
        self.lag_skips = Counter(
            "turboserve_lag_skips",
            "Times a slow client was skipped to the live edge",
            ["transport"],
            registry=r,
        )
        self.refusals = Counter(
            "turboserve_refusals", "Requests refused, by error code", ["code"], registry=r
        )
        self.input_frames = Counter(
            "turboserve_gateway_input_frames",
            "Video sessions' input frames: relayed to the owner, dropped (the oldest, from a "
            "full buffer) or refused (a bad frame)",
            ["outcome"],
            registry=r,
        )
        self.foreign_owner_dropped = Counter(
            "turboserve_gateway_foreign_owner_dropped",
            "Chunks and notices dropped because the worker and epoch they carry are not an "
            "owner the registry gave the session",
            registry=r,
        )
        for outcome in INPUT_OUTCOMES:
            self.input_frames.labels(outcome)
        for transport in CLIENT_TRANSPORTS:
            self.clients.labels(transport)
            self.lag_skips.labels(transport)
        for state in SessionState:
            self.sessions.labels(state.value)
        for activity in Activity:
            self.activity.labels(activity.value)

    def observe_chunk(self, chunk: ChunkView) -> float:
        """Count a live chunk; returns its latency in ms."""
        late_s = max(0.0, chunk.done_at - chunk.due_at)
        self.chunks.inc()
        self.chunk_latency.observe(late_s)
        if late_s > 0:
            self.deadline_misses.inc()
        return late_s * 1000.0

    def set_sessions(self, by_state: dict[str, int], by_activity: dict[str, int]) -> None:
        for state in SessionState:
            self.sessions.labels(state.value).set(by_state.get(state.value, 0))
        for activity in Activity:
            self.activity.labels(activity.value).set(by_activity.get(activity.value, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)

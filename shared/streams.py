"""JetStream streams of the protocol, declared in one place and created idempotently.

- sessions: gateway -> scheduler session events; a work queue with a durable consumer, kept on
  disk, so no event is lost while the scheduler restarts.
- chunks: worker -> gateways; in memory, short retention, a bounded number per session, so any
  gateway can stream any session and a reconnecting client (``Last-Event-ID``) gets what it missed.
"""

from __future__ import annotations

from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError

from shared.wire import Subjects

CHUNK_RETENTION_S = 300.0
CHUNKS_PER_SESSION = 64
SCHEDULER_DURABLE = "scheduler"


def stream_configs(subjects: Subjects) -> list[api.StreamConfig]:
    return [
        api.StreamConfig(
            name=subjects.sessions_stream,
            subjects=[subjects.session_events],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            max_age=24 * 3600.0,
        ),
        api.StreamConfig(
            name=subjects.chunks_stream,
            subjects=[subjects.chunks_wildcard],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.MEMORY,
            max_age=CHUNK_RETENTION_S,
            max_msgs_per_subject=CHUNKS_PER_SESSION,
            max_bytes=512 * 1024 * 1024,
            discard=api.DiscardPolicy.OLD,
        ),
    ]


async def ensure_streams(js: JetStreamContext, subjects: Subjects) -> None:
    """Create the streams, or bring an existing one's config up to date."""
    for config in stream_configs(subjects):
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)

"""JetStream streams of the protocol, declared in one place and created idempotently.

- sessions: gateway -> scheduler session events; a work queue with a durable consumer, kept on
  disk, so no event is lost while the scheduler restarts.
- chunks: worker -> gateways; in memory, short retention, a bounded number per session, so any
  gateway can stream any session and a reconnecting client (``Last-Event-ID``) gets what it missed.
  Its bytes are sized for that resume window: ``TURBOSERVE_STREAM_SESSIONS`` sessions x
  ``CHUNKS_PER_SESSION`` chunks x the most bytes a chunk's message takes at
  ``TURBOSERVE_VIDEO_BITRATE`` (:class:`shared.video.ChunkRetention`; docs/gateway.md).
"""

from __future__ import annotations

from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError, ServerError

from shared.video import CHUNK_RETENTION_S, CHUNKS_PER_SESSION, ChunkRetention
from shared.wire import Subjects

SCHEDULER_DURABLE = "scheduler"


def stream_configs(
    subjects: Subjects, retention: ChunkRetention | None = None, replicas: int = 1
) -> list[api.StreamConfig]:
    """The two streams, each with ``replicas`` copies (3 on a JetStream cluster: a stream then
    has a Raft leader, and survives the death of its node)."""
    retention = retention or ChunkRetention()
    return [
        api.StreamConfig(
            name=subjects.sessions_stream,
            subjects=[subjects.session_events],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            max_age=24 * 3600.0,
            num_replicas=replicas,
        ),
        api.StreamConfig(
            name=subjects.chunks_stream,
            subjects=[subjects.chunks_wildcard],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.MEMORY,
            max_age=CHUNK_RETENTION_S,
            max_msgs_per_subject=CHUNKS_PER_SESSION,
            max_bytes=retention.max_bytes,
            discard=api.DiscardPolicy.OLD,
            num_replicas=replicas,
        ),
    ]


async def ensure_streams(
    js: JetStreamContext,
    subjects: Subjects,
    retention: ChunkRetention | None = None,
    replicas: int = 1,
) -> None:
    """Create the streams, or bring an existing one's config up to date (the chunk stream's
    bytes from ``retention``: every service passes its settings' own)."""
    for config in stream_configs(subjects, retention, replicas):
        try:
            await js.add_stream(config)
        except (BadRequestError, ServerError) as refused:
            # It exists (declared by another service, or before a restart): JetStream refuses
            # the add, as a bad request, or, counting the stream's memory twice, as a lack of
            # memory; an update takes the config as it is now. Where there is no such stream,
            # the add's own refusal is the fault (the server has not the memory for it).
            try:
                await js.update_stream(config)
            except NotFoundError:
                raise refused from None

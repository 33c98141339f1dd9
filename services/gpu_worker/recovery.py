"""The worker's recovery log: a session's ``RecoveryPoint`` as the fields Redis keeps.

After every chunk the owner writes the point with its progress (one compare-and-set, so the log
and ``last_seq`` always agree); a worker that is given the session after its owner was lost
reads it and rebuilds the session (``Engine.restore``) instead of starting it over.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from services.gpu_worker.engine import RecoveryPoint

FORMAT = "2"  # 2: the latent history only (the decoder state is rebuilt)


def to_fields(point: RecoveryPoint, next_wire_seq: int) -> dict[str, bytes | str]:
    """``next_wire_seq``: the wire seq of the session's next chunk (the point's engine seq,
    shifted as the worker numbers the session's chunks)."""
    return {
        "format": FORMAT,
        "next_seq": str(next_wire_seq),
        "engine_seq": str(point.seq),
        "position": str(point.position),
        "prompt": point.prompt,
        "pending_prompt": orjson.dumps(point.pending_prompt),
        "seed": str(point.seed),
        "preset": point.preset,
        "dtype": point.dtype,
        "meta": orjson.dumps(point.meta),
        "history": point.history,
    }


def from_fields(session_id: str, fields: Mapping[str, bytes]) -> tuple[RecoveryPoint, int] | None:
    """The point and the wire seq of its next chunk; None for a log this code cannot read."""
    try:
        if fields["format"].decode() != FORMAT:
            return None
        point = RecoveryPoint(
            session_id=session_id,
            seq=int(fields["engine_seq"]),
            position=int(fields["position"]),
            prompt=fields["prompt"].decode(),
            pending_prompt=orjson.loads(fields["pending_prompt"]),
            seed=int(fields["seed"]),
            preset=fields["preset"].decode(),
            dtype=fields["dtype"].decode(),
            history=bytes(fields["history"]),
            meta={str(k): str(v) for k, v in orjson.loads(fields["meta"]).items()},
        )
        return point, int(fields["next_seq"])
    except (KeyError, ValueError, UnicodeDecodeError, orjson.JSONDecodeError, AttributeError):
        return None

"""The GPU worker's batch engine (slots, coalesced passes with pass-level admission,
suspend/resume, export/import)."""

from .engine import Engine, next_chunks, noise_seed, resolve_device
from .types import (
    ChunkResult,
    EngineConfig,
    EngineError,
    EngineFull,
    IncompatibleState,
    MidChunk,
    RecoveryPoint,
    SessionAlreadyResident,
    SessionSnapshot,
    StateLayout,
    UnknownSession,
    WrongSessionState,
)

__all__ = [
    "ChunkResult",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineFull",
    "IncompatibleState",
    "MidChunk",
    "RecoveryPoint",
    "SessionAlreadyResident",
    "SessionSnapshot",
    "StateLayout",
    "UnknownSession",
    "WrongSessionState",
    "next_chunks",
    "noise_seed",
    "resolve_device",
]

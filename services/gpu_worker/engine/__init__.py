"""The GPU worker's batch engine (slots, coalesced step and pass-level admission,
suspend/resume, export/import)."""

from .engine import Engine, noise_seed, resolve_device
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
    "UnknownSession",
    "WrongSessionState",
    "noise_seed",
    "resolve_device",
]

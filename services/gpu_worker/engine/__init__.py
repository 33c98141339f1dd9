"""The GPU worker's batch engine (slots, coalesced passes with pass-level admission,
suspend/resume, export/import)."""

from .engine import Engine, next_chunks
from .memory import MemoryBudgetExceeded
from .types import (
    ChunkResult,
    EngineConfig,
    EngineError,
    EngineFull,
    IncompatibleState,
    MidChunk,
    PassOutOfMemory,
    RecoveryPoint,
    SessionAlreadyResident,
    StateLayout,
    StepFloorAboveFull,
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
    "MemoryBudgetExceeded",
    "MidChunk",
    "PassOutOfMemory",
    "RecoveryPoint",
    "SessionAlreadyResident",
    "StateLayout",
    "StepFloorAboveFull",
    "UnknownSession",
    "WrongSessionState",
    "next_chunks",
]

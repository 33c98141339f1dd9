"""The engine's public value types and errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.wire import SessionInput


@dataclass(frozen=True, slots=True)
class EngineConfig:
    preset: str = "tiny"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    # Session slots; None: as many as the memory budget gives (``memory.py``), up to the
    # default count (``shared.settings.DEFAULT_SLOTS``). A number that does not fit is
    # refused at start (``MemoryBudgetExceeded``).
    max_sessions: int | None = 8
    # The chunks one pass may decode (the decoder's peak memory is per chunk); the others
    # finish at the next pass. None: every chunk that completes.
    max_decodes_per_pass: int | None = None
    # Suspend buffers kept for reuse (page-locked on a GPU: allocating them costs far more
    # than the copy); more are freed when their session resumes or leaves.
    spare_host_buffers: int = 2
    seed: int = 0  # weight seed: workers with the same seed hold the same random weights
    # The causal DiT: safetensors or .pt (Self-Forcing, LongLive), Wan or diffusers naming.
    checkpoint: str | None = None
    # A Wan2.1 text-to-video model folder (diffusers or original layout): umT5, the Wan VAE and,
    # unless ``checkpoint`` names it, the DiT. None: the stand-ins (``model/load.py``).
    model: str | None = None
    resolution: tuple[int, int] | None = None  # (height, width); None: preset's / 480x832
    text_device: str | None = None  # where umT5 runs; None: the engine's device
    dtype: str | None = None  # None: bfloat16 on a GPU, float32 on the CPU
    pin_host_memory: bool = True  # suspended state in page-locked memory (GPU only)
    # On a prompt switch: "kv" recomputes the cached frames' keys/values under the new prompt
    # (LongLive's KV re-cache); "cross" only swaps the cross-attention cache; "auto": "kv" for
    # LongLive checkpoints and the stand-in, "cross" for other checkpoints.
    prompt_recache: str = "auto"
    # The quality budget's floor: the fewest denoising steps a chunk may run (None: the
    # model's full count, the budget off). Above the full count, the engine refuses to load.
    min_steps: int | None = None

    def __post_init__(self) -> None:
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.max_decodes_per_pass is not None and self.max_decodes_per_pass < 1:
            raise ValueError(f"max_decodes_per_pass must be >= 1, got {self.max_decodes_per_pass}")
        if self.spare_host_buffers < 0:
            raise ValueError(f"spare_host_buffers must be >= 0, got {self.spare_host_buffers}")
        if self.min_steps is not None and self.min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {self.min_steps}")
        if self.prompt_recache not in ("auto", "kv", "cross"):
            raise ValueError(
                f"prompt_recache must be 'auto', 'kv' or 'cross', got {self.prompt_recache!r}"
            )


@dataclass(frozen=True, slots=True)
class ChunkResult:
    session_id: str
    seq: int  # 0 for a session's first chunk
    frames: torch.Tensor  # uint8 [T, H, W, 3] on the CPU
    gen_ms: float  # the sum of the wall times of the passes that made this chunk
    batch: int  # sessions in the pass that completed the chunk
    steps: int  # the denoising steps it ran (the budget in force when it started)
    input_seq: int = -1  # a video session's: the seq of the last input frame it was made from


@dataclass(slots=True)
class SessionSnapshot:
    """Everything a session needs to continue elsewhere: one flat tensor per layer (the
    slot's contiguous region: self-attention KV window and cross-attention cache), one for
    the rest (decoder context), and metadata. Noise is derived from (seed, seq, step), so the
    seed and seq are the whole RNG state."""

    session_id: str
    seq: int
    position: int  # latent frames written to the cache
    prompt: str
    seed: int
    preset: str
    dtype: str
    layers: list[torch.Tensor]
    misc: torch.Tensor
    pending_prompt: str | None = None
    meta: dict[str, str] = field(default_factory=dict)
    input: SessionInput = SessionInput.TEXT
    strength: float | None = None  # a video session's (None: DEFAULT_STRENGTH)

    @property
    def nbytes(self) -> int:
        tensors = [*self.layers, self.misc]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """What a session's state must have been made with to continue on an engine: its preset,
    dtype, slot layout and weights. Immutable, so any thread may check a state against it
    (the handoff's admission runs on the event loop, before a byte moves)."""

    preset: str
    dtype: str
    num_layers: int
    region_numel: int
    misc_numel: int
    weights_seed: str  # decides the untrained DiT and, always, the stand-in decoder
    checkpoint: str  # the checkpoint's description, for messages
    checkpoint_digest: str  # its content hash ("none" without one)

    @property
    def meta(self) -> dict[str, str]:
        """What an exported state or a recovery point carries of the weights."""
        return {
            "weights_seed": self.weights_seed,
            "checkpoint": self.checkpoint,
            "checkpoint_digest": self.checkpoint_digest,
        }

    def check(self, state: SessionSnapshot) -> None:
        """Raises ``IncompatibleState`` unless ``state`` was made by an engine like this one.
        Reads shapes only: meta tensors will do."""
        checks = [
            ("preset", state.preset, self.preset),
            ("dtype", state.dtype, self.dtype),
            ("layers", len(state.layers), self.num_layers),
            ("region numel", {t.numel() for t in state.layers}, {self.region_numel}),
            ("misc numel", state.misc.numel(), self.misc_numel),
        ]
        for name, got, expected in checks:
            if got != expected:
                raise IncompatibleState(name, got, expected)
        # Same layout is not enough: caches computed with other weights (another weight seed
        # or checkpoint) would be silently wrong here.
        if state.meta.get("weights_seed") != self.weights_seed:
            raise IncompatibleState(
                "weights_seed", state.meta.get("weights_seed"), self.weights_seed
            )
        if state.meta.get("checkpoint_digest") != self.checkpoint_digest:
            raise IncompatibleState("checkpoint", state.meta.get("checkpoint"), self.checkpoint)


@dataclass(frozen=True, slots=True)
class RecoveryPoint:
    """What rebuilds a session after its worker is lost, small enough to log after every chunk:
    the clean latents of the frames in the attention window and the sink (the first part of
    the slot's ``misc`` region), the prompt, the seed and the position. The KV cache and the
    decoder's state are rebuilt from the latents (``Engine.restore``), not stored: the Wan
    VAE's cache alone is 1.9 GB per session at 480x832."""

    session_id: str
    seq: int  # engine seq of the next chunk
    position: int
    prompt: str
    pending_prompt: str | None
    seed: int
    preset: str
    dtype: str
    history: bytes  # the latent history, raw, in ``dtype``
    meta: dict[str, str] = field(default_factory=dict)


class EngineError(Exception):
    retryable = False


class EngineFull(EngineError):
    """No free slot. Retrying helps once a session is suspended or removed."""

    retryable = True

    def __init__(self, capacity: int) -> None:
        super().__init__(f"all {capacity} session slots are in use")
        self.capacity = capacity


class UnknownSession(EngineError, KeyError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id!r} on this engine")
        self.session_id = session_id


class SessionAlreadyResident(EngineError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is already on this engine")
        self.session_id = session_id


class WrongSessionState(EngineError):
    """E.g. resume of a session that is not suspended."""

    def __init__(self, session_id: str, state: str, wanted: str) -> None:
        super().__init__(f"session {session_id!r} is {state}, needs to be {wanted}")
        self.session_id = session_id
        self.state = state
        self.wanted = wanted


class MidChunk(EngineError):
    """The session is part-way through a chunk (``Engine.pass_step``): its state cannot leave
    the engine until the chunk's last pass. ``passes_left`` passes bring it to the boundary;
    ``suspend(session_id, wait=True)`` suspends it there instead."""

    retryable = True

    def __init__(self, session_id: str, passes_left: int, action: str) -> None:
        super().__init__(
            f"cannot {action} session {session_id!r} mid-chunk: {passes_left} more pass(es) to "
            f"its chunk boundary"
        )
        self.session_id = session_id
        self.passes_left = passes_left
        self.action = action


class PassOutOfMemory(EngineError):
    """A pass (or a restore, which runs the model) ran out of device memory. Its sessions left the engine (their state is not
    whole after a pass that stopped part-way: they continue elsewhere from their last chunk
    boundary), the allocator's cache was emptied, and the capacity lowered to ``capacity``."""

    retryable = True

    def __init__(self, sessions: list[str], capacity: int, error: str) -> None:
        super().__init__(
            f"a pass of {len(sessions)} session(s) ran out of memory ({error}); they left "
            f"the engine, whose capacity is now {capacity}"
        )
        self.sessions = sessions
        self.capacity = capacity


class StepFloorAboveFull(ValueError):
    """``EngineConfig.min_steps`` is above the loaded model's full count of denoising steps
    (known only once the model is loaded)."""

    def __init__(self, min_steps: int, full_steps: int, model: str) -> None:
        super().__init__(
            f"min_steps {min_steps} is above the full count of denoising steps of "
            f"{model!r} ({full_steps})"
        )
        self.min_steps = min_steps
        self.full_steps = full_steps
        self.model = model


class IncompatibleState(EngineError):
    """An imported state made for another preset, dtype or layout."""

    def __init__(self, field_name: str, got: object, expected: object) -> None:
        super().__init__(f"state {field_name} is {got!r}, this engine needs {expected!r}")
        self.field_name = field_name
        self.got = got
        self.expected = expected

"""The batch engine: sessions in preallocated slots, one coalesced model pass at a time.

One driver, ``pass_step()`` (pass-level admission): one batched pass for every resident
session, each at its own phase of its own chunk; a session that joins starts at the next pass
and its chunk is done ``steps + 1`` passes later (``passes_per_chunk`` at full steps).
``next_chunks(engine)`` runs passes until every session completed one chunk, for the benches,
tests and tools that want one whole chunk of every session.

The quality budget: a chunk runs the step count in force when it starts
(:meth:`Engine.set_step_budget`, between the operator's floor and the model's full count), a
sub-schedule of the full one (``model/schedule.py``), then the cache-write pass; sessions at
different step counts share a pass, each row at its own timestep.

Blocking and not thread-safe: one thread owns an engine (in the worker, the generation
thread), so every change lands between passes. The values other threads may read are in
``Engine.layout`` (immutable) and in what the owning thread copies out.
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import structlog
import torch

from shared.logging import get_logger
from shared.settings import DEFAULT_SLOTS
from shared.wire import DEFAULT_STRENGTH, SessionInput

from .. import telemetry as telemetry_mod
from ..input_frames import InputBuffer
from ..model.config import ModelConfig
from ..model.dit import ChunkCaches
from ..model.load import LoadedModel, ModelSpec, load_model
from ..model.schedule import sigmas, sub_schedule
from . import memory
from .prompts import PromptEncoder
from .slots import SlotPool, SlotReservations, wait_for_stream
from .types import (
    ChunkResult,
    EngineConfig,
    EngineFull,
    IncompatibleState,
    MidChunk,
    PassOutOfMemory,
    RecoveryPoint,
    SessionAlreadyResident,
    SessionSnapshot,
    StateLayout,
    StepFloorAboveFull,
    UnknownSession,
    WrongSessionState,
)

log = get_logger("turboserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def noise_seed(seed: int, seq: int, step: int) -> int:
    """The seed of one noise draw: a session's RNG state is just (seed, seq)."""
    digest = hashlib.blake2b(f"{seed}:{seq}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _log_if_configured(event: str, **facts: Any) -> None:
    if structlog.is_configured():
        log.info(event, **facts)


def draw_noise(
    seeds: list[int], shape: tuple[int, ...], generator: torch.Generator | None = None
) -> torch.Tensor:
    """``[len(seeds), *shape]`` standard normal float32 noise on the CPU, row ``i`` drawn from
    a CPU generator seeded with ``seeds[i]``: the same numbers on any host and any GPU."""
    generator = torch.Generator() if generator is None else generator
    out = torch.empty(len(seeds), *shape)
    for row, seed in zip(out, seeds, strict=True):
        generator.manual_seed(seed)
        torch.randn(shape, generator=generator, out=row)
    return out


@dataclass(slots=True)
class _Session:
    session_id: str
    seed: int
    prompt: str
    seq: int = 0
    position: int = 0
    pending_prompt: str | None = None
    host: SessionSnapshot | None = None  # set while suspended
    host_exported: bool = False  # the host buffers were handed out: never recycle them
    # Pass-level admission (pass_step): passes of the current chunk already run (0 = at a chunk
    # boundary); the chunk's latent in progress lives in the slot's ``pool.inflight`` row.
    phase: int = 0
    steps: int = 0  # denoising steps of the current chunk, fixed at its first pass
    chunk_ms: float = 0.0  # wall time of the current chunk's passes so far
    chunk_batch: int = 0  # batch of its passes so far; -1 once it changed mid-chunk
    suspend_requested: bool = False  # suspend(wait=True) mid-chunk: suspend at the boundary
    awaiting_text: bool = False  # resident, out of the batch until its prompt is encoded
    input: SessionInput = SessionInput.TEXT
    strength: float | None = None  # a video session's (None: DEFAULT_STRENGTH)
    # The noise levels of the current chunk's denoising steps, fixed at its first pass: a
    # sub-schedule of the budget's, shorter for a video session (its strength).
    levels: tuple[float, ...] = ()
    input_seq: int = -1  # the last input frame of the current chunk (a video session's)

    @property
    def suspended(self) -> bool:
        return self.host is not None


@contextlib.contextmanager
def _flush_denormals(enabled: bool) -> Iterator[None]:
    """Flush subnormal floats to zero for the duration of one pass on the CPU.

    Random-weight activations produce subnormals, which x86 handles ~100x slower (a 10x slower
    pass was measured). The flag is per-thread CPU state (MXCSR), so it is set on the thread that
    computes, for the call only: it must not leak into the rest of the process (it breaks, e.g.,
    hypothesis's float strategies in the same test run).
    """
    if not enabled:
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded``: components built elsewhere (the GPU check's random weights in Wan's
        geometry), in this engine's dtype on its device; None: as ``config`` says."""
        self.config = config
        self._device = resolve_device(config.device)
        default = "bfloat16" if self._device.type == "cuda" else "float32"
        self.dtype = _DTYPES[config.dtype or default]
        self._pin = config.pin_host_memory and self._device.type == "cuda"
        spec = ModelSpec(
            preset=config.preset,
            checkpoint=config.checkpoint,
            model=config.model,
            resolution=config.resolution,
            text_device=config.text_device,
            seed=config.seed,
        )
        loaded = loaded or load_model(spec, self._device, self.dtype)
        self.model_config: ModelConfig = loaded.config
        self.model = loaded.dit
        self.decoder = loaded.decoder
        self.encoder = loaded.encoder
        self.text_encoder = loaded.text_encoder
        self.sources = loaded.sources
        recache = config.prompt_recache
        if recache == "auto":  # LongLive's re-cache for LongLive and the stand-in
            recache = "kv" if loaded.longlive or not config.checkpoint else "cross"
        self.prompt_recache = recache
        self.prompts = PromptEncoder(self.text_encoder)
        self.memory = self._memory_budget(config)
        self._capacity = self.memory.sessions
        # Services configure logging (to stderr); a tool that did not keeps its stdout clean.
        _log_if_configured(
            "memory_budget",
            device=str(self._device),
            sessions=self._capacity,
            slot_bytes=self.memory.slot_bytes,
            slots_bytes=self._capacity * self.memory.slot_bytes,
            needed_bytes=self.memory.needed(self._capacity),
            available_bytes=self.memory.available,
            decode_peak_bytes=self.memory.decode_peak,
            decode_measured=self.memory.decode_measured,
            max_decodes_per_pass=config.max_decodes_per_pass,
        )
        self.pool = SlotPool(
            self.model_config,
            self._capacity,
            self._device,
            self.dtype,
            self.decoder.state_numel,
            self.encoder.state_numel,
        )
        # Slots held for arriving handoffs (the engine's only thread-safe part).
        self.reservations = SlotReservations(self.pool)
        self._sigmas = sigmas(self.model_config)  # the full schedule
        full = len(self._sigmas)
        self._min_steps = full if config.min_steps is None else config.min_steps
        if self._min_steps > full:
            raise StepFloorAboveFull(self._min_steps, full, self.model_config.name)
        self._steps = full  # the budget in force (set_step_budget)
        # Per step count: each denoising step's noise level.
        self._schedules = {s: tuple(sub_schedule(self._sigmas, s)) for s in range(1, full + 1)}
        self._sessions: dict[str, _Session] = {}
        self._resident: list[str] = []  # slot i holds self._resident[i]
        # Noise is drawn on the CPU and copied over: CUDA's generator gives other numbers on
        # GPUs with other SM counts, so a session moved across GPU kinds would not continue
        # exactly (the state layout's check cannot see the GPU model).
        self._generator = torch.Generator()
        self._chunk_ms: dict[int, deque[float]] = {}
        self._pass_ms: dict[int, deque[float]] = {}
        self._switch_ms: deque[float] = deque(maxlen=64)  # prompt switches (incl. re-cache)
        self._decode_ms: dict[int, deque[float]] = {}  # per batch of the decoded chunks
        self._encode_ms: dict[int, deque[float]] = {}  # per batch of the encoded input chunks
        # Video sessions' input frames, put by the event loop's thread (InputBuffer is
        # thread-safe); the dict itself changes under the lock only.
        self._inputs: dict[str, InputBuffer] = {}
        self._inputs_lock = threading.Lock()
        self._spare_host: list[list[torch.Tensor]] = []  # recycled suspend buffers
        # What an imported state's caches must have been computed with: the weight seed (it
        # decides the random DiT and the stand-in decoder) and the weights' content.
        digest, description = loaded.identity
        self.layout = StateLayout(
            preset=self.model_config.name,
            dtype=str(self.dtype).removeprefix("torch."),
            num_layers=self.model_config.num_layers,
            region_numel=self.pool.region_numel,
            misc_numel=self.pool.misc_numel,
            weights_seed=str(config.seed),
            checkpoint=description,
            checkpoint_digest=digest,
        )

    # -- properties ---------------------------------------------------------------------
    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def torch_device(self) -> torch.device:
        return self._device

    @property
    def capacity(self) -> int:
        """Sessions this engine takes: the memory budget's, lowered after a pass that ran out
        of memory (the slots stay allocated; fewer sessions decode less at once)."""
        return self._capacity

    # -- memory ---------------------------------------------------------------------------
    def _memory_budget(self, config: EngineConfig) -> memory.MemoryBudget:
        """How many slots fit (``memory.py``), before any is allocated."""
        empty = SlotPool(
            self.model_config,
            0,
            self._device,
            self.dtype,
            self.decoder.state_numel,
            self.encoder.state_numel,
        )
        peak, measured = self._decode_peak()
        budget = memory.MemoryBudget(
            where=str(self._device),
            available=memory.available_bytes(self._device),
            slot_bytes=empty.memory_per_slot,
            decode_peak=peak,
            decode_measured=measured,
            max_decodes=config.max_decodes_per_pass,
        )
        return memory.plan(budget, config.max_sessions, DEFAULT_SLOTS)

    @torch.inference_mode()
    def _decode_peak(self) -> tuple[int, bool]:
        """What one chunk's decode allocates beyond its inputs: measured on CUDA (a decode of
        zeros, fresh and continuing), estimated on the CPU (no allocator statistics there)."""
        config = self.model_config
        shape = (1, config.out_dim, config.chunk_frames, config.latent_height, config.latent_width)
        numel = self.decoder.state_numel
        item = torch.empty((), dtype=self.dtype).element_size()
        if self._device.type != "cuda":
            frames = config.video_frames_per_chunk * config.height * config.width * 3 * 4
            return memory.estimated_decode_peak(numel * item, frames), False
        latents = torch.zeros(shape, device=self._device)
        state = torch.zeros(1, numel, device=self._device, dtype=self.dtype)
        peak = 0
        for fresh in (True, False):
            wait_for_stream(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
            base = torch.cuda.memory_allocated(self._device)
            self.decoder.decode(latents, state, fresh)
            wait_for_stream(self._device)
            peak = max(peak, torch.cuda.max_memory_allocated(self._device) - base)
        del latents, state
        memory.free_device_memory(self._device)
        return peak, True

    def _bound_decodes(self, chosen: Collection[str]) -> list[str]:
        """``chosen`` without the sessions whose chunk would complete in this pass beyond
        ``max_decodes_per_pass`` (the first ones keep their turn): those run their
        cache-write pass, and decode, at a next pass."""
        bound = self.config.max_decodes_per_pass
        assert bound is not None
        finishing = [
            sid for sid in chosen if 0 < self._sessions[sid].phase == self._sessions[sid].steps
        ]
        later = set(finishing[bound:])
        return [sid for sid in chosen if sid not in later]

    def _out_of_memory(self, session_ids: list[str], error: str, load: int) -> PassOutOfMemory:
        """After a pass (or a restore) ran out of memory: its sessions leave (their state is not
        whole), the spare host buffers and the allocator's cache are freed, and the capacity
        drops below ``load``, the sessions the failed work ran for (never below one)."""
        for sid in session_ids:
            if sid in self._sessions:
                self.remove_session(sid)
        self._spare_host.clear()
        memory.free_device_memory(self._device)
        self._capacity = max(1, min(self._capacity, load) - 1)
        log.warning(
            "pass_out_of_memory", sessions=session_ids, capacity=self._capacity, error=error
        )
        return PassOutOfMemory(session_ids, self._capacity, error)

    @property
    def fill_chunks(self) -> int:
        """Chunks after which a new session's KV window is full (steady state, no mask)."""
        config = self.model_config
        return (config.sink_frames + config.window_frames) // config.chunk_frames

    @property
    def passes_per_chunk(self) -> int:
        """Batched model passes per chunk at full steps: the denoising steps plus the
        cache-write pass (a chunk at ``s`` steps takes ``s + 1``)."""
        return len(self._sigmas) + 1

    @property
    def full_steps(self) -> int:
        """The model's full count of denoising steps per chunk."""
        return len(self._sigmas)

    @property
    def min_steps(self) -> int:
        """The floor of the step budget (``EngineConfig.min_steps``; the full count: the
        budget is off)."""
        return self._min_steps

    @property
    def steps(self) -> int:
        """The step budget in force: the denoising steps of every chunk that starts now."""
        return self._steps

    def set_step_budget(self, steps: int) -> int:
        """Chunks that start from the next pass on run ``steps`` denoising steps, clamped to
        ``[min_steps, full_steps]``; returns the count applied. A chunk in progress keeps
        the count it started with."""
        self._steps = max(self._min_steps, min(self.full_steps, steps))
        return self._steps

    def passes_to_boundary(self, session_id: str) -> int:
        """Passes until the session's current chunk is done (0: it is at a chunk boundary,
        where suspend/export are allowed and a new prompt applies); counted at the chunk's
        own step count."""
        session = self._get(session_id)
        return session.steps + 1 - session.phase if session.phase else 0

    @property
    def state_bytes(self) -> int:
        return self.pool.bytes_per_slot

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def active_sessions(self) -> list[str]:
        return list(self._resident)

    def phases(self) -> dict[str, int]:
        """Passes of its current chunk each resident session has run (0: at a boundary)."""
        return {sid: self._sessions[sid].phase for sid in self._resident}

    def prompt_of(self, session_id: str) -> str:
        """The prompt the session's chunks follow now (a pending one once it applies)."""
        session = self._get(session_id)
        return session.pending_prompt or session.prompt

    def prompt_applied(self, session_id: str, prompt: str) -> bool:
        """Whether ``prompt`` is the one the session's chunks follow now (no change pending)."""
        session = self._get(session_id)
        return session.pending_prompt is None and session.prompt == prompt

    def seed_of(self, session_id: str) -> int:
        return self._get(session_id).seed

    def next_seq(self, session_id: str) -> int:
        """The engine seq of the session's next chunk to complete (0 for a new session)."""
        return self._get(session_id).seq

    def suspended_sessions(self) -> list[str]:
        return [s.session_id for s in self._sessions.values() if s.suspended]

    # -- video input --------------------------------------------------------------------
    def video_sessions(self) -> list[str]:
        """The video sessions here (resident or suspended): those whose input frames this
        engine takes. Thread-safe."""
        with self._inputs_lock:
            return list(self._inputs)

    def input_buffer(self, session_id: str) -> InputBuffer | None:
        """Where a video session's input frames go (None: no such video session here).
        Thread-safe: the event loop puts frames, the pass takes them."""
        with self._inputs_lock:
            return self._inputs.get(session_id)

    def input_frames(self, session_id: str) -> int:
        """Video frames the session's next input chunk needs (as many as its output chunk
        will have: output chunk ``n`` is made from input chunk ``n``)."""
        return self.encoder.input_frames(self._get(session_id).position == 0)

    def input_ready(self, session_id: str) -> bool:
        """Whether the session can start its next chunk: a text session always; a video
        session once its input chunk is there (mid-chunk it already took it)."""
        session = self._get(session_id)
        if session.input is not SessionInput.VIDEO or session.phase:
            return True
        buffer = self.input_buffer(session_id)
        return buffer is not None and buffer.ready(self.encoder.input_frames(session.position == 0))

    def _open_input(self, session: _Session) -> None:
        if session.input is SessionInput.VIDEO:
            frames = self.encoder.input_frames(False)
            with self._inputs_lock:
                self._inputs.setdefault(session.session_id, InputBuffer(capacity=2 * frames))

    def _close_input(self, session_id: str) -> None:
        with self._inputs_lock:
            self._inputs.pop(session_id, None)

    def strength_of(self, session_id: str) -> float | None:
        """A video session's strength (None: a text session)."""
        session = self._get(session_id)
        if session.input is not SessionInput.VIDEO:
            return None
        return DEFAULT_STRENGTH if session.strength is None else session.strength

    def input_of(self, session_id: str) -> SessionInput:
        return self._get(session_id).input

    # -- session lifecycle --------------------------------------------------------------
    def add_session(
        self,
        session_id: str,
        prompt: str,
        seed: int,
        *,
        input: SessionInput = SessionInput.TEXT,
        strength: float | None = None,
    ) -> None:
        """A new session; a video one (``input``) generates from the input frames put in its
        :meth:`input_buffer`, restyled at ``strength`` (None: ``DEFAULT_STRENGTH``)."""
        if session_id in self._sessions:
            raise SessionAlreadyResident(session_id)
        slot = self._claim_slot()
        self.pool.clear(slot)
        session = _Session(session_id, seed, prompt, input=input, strength=strength)
        self._open_input(session)
        embedding = self.prompts.ready(prompt)
        if embedding is None:
            session.awaiting_text = True  # joins the batch once the encoder is done
        else:
            self._write_prompt(slot, embedding)
        self._sessions[session_id] = session
        self._resident.append(session_id)

    def set_prompt(self, session_id: str, prompt: str, *, strength: float | None = None) -> None:
        """The new prompt conditions chunks from the next one on (LongLive's re-cache of the
        cross-attention at a chunk boundary). Mid-chunk (pass_step), the chunk in progress
        keeps the old prompt. A prompt still being encoded (umT5, off the pass) applies at the
        first boundary after its encoding finished. ``strength`` (a video session's; None:
        unchanged) applies from the next chunk that starts."""
        session = self._get(session_id)
        if strength is not None and session.input is SessionInput.VIDEO:
            session.strength = strength
        if prompt == session.prompt and session.pending_prompt is None:
            return  # the strength alone changed
        self.prompts.request(prompt)
        session.pending_prompt = prompt

    def suspend(self, session_id: str, *, wait: bool = False) -> bool:
        """Moves the session's state to host memory; True when done.

        A session is suspended only at a chunk boundary. Mid-chunk (under ``pass_step``) this
        raises ``MidChunk``, or with ``wait=True`` returns False and suspends the session
        right after the pass that completes its current chunk (whose ``ChunkResult`` that
        pass_step returns as usual); a ``resume`` before then cancels the request."""
        session = self._get(session_id)
        if session.suspended:
            raise WrongSessionState(session_id, "suspended", "executing")
        if session.phase:
            if not wait:
                raise MidChunk(session_id, self.passes_to_boundary(session_id), "suspend")
            session.suspend_requested = True
            return False
        self._suspend_now(session)
        return True

    def _suspend_now(self, session: _Session) -> None:
        spare = self._spare_host.pop() if self._spare_host else None
        session.host = self._read_state(session, into=spare)
        session.host_exported = False
        session.suspend_requested = False
        self._release_slot(session.session_id)

    def resume(self, session_id: str) -> None:
        """Makes a suspended session resident again; its next chunk starts at the next pass.
        On a session with a pending ``suspend(wait=True)``, cancels that request."""
        session = self._get(session_id)
        if session.host is None:
            if session.suspend_requested:
                session.suspend_requested = False
                return
            raise WrongSessionState(session_id, "executing", "suspended")
        slot = self._claim_slot()
        self.pool.write(slot, session.host.layers, session.host.misc)
        self._recycle_host(session)
        self._resident.append(session_id)
        buffer = self.input_buffer(session_id)
        if buffer is not None:  # frames from before the pause: the live input goes on from now
            buffer.clear()

    def remove_session(self, session_id: str) -> None:
        session = self._get(session_id)
        if session.suspended:
            self._recycle_host(session)
        else:
            self._release_slot(session_id)
        del self._sessions[session_id]
        self._close_input(session_id)

    def export_state(self, session_id: str, *, on_device: bool = False) -> SessionSnapshot:
        """A copy of the session's state; the session itself is left as it was. A host copy,
        or with ``on_device`` (a handoff over NCCL or CUDA IPC) a clone on the engine's device,
        which never changes when the slots move; a suspended session's state is in host memory
        either way. Only at a chunk boundary: mid-chunk (pass_step) raises ``MidChunk``. So a
        state never carries a step count: its next chunk takes the budget of the engine it
        runs on."""
        session = self._get(session_id)
        if session.host is not None:
            session.host_exported = True
            # The tensors were captured at suspend time and do not change while suspended,
            # but the session's fields may (set_prompt): export the live ones.
            return replace(
                session.host,
                seq=session.seq,
                position=session.position,
                prompt=session.prompt,
                pending_prompt=session.pending_prompt,
                meta=dict(session.host.meta),
                strength=session.strength,
            )
        if session.phase:
            raise MidChunk(session_id, self.passes_to_boundary(session_id), "export")
        return self._read_state(session, on_device=on_device)

    def import_state(self, state: SessionSnapshot, *, suspended: bool = False) -> None:
        """Makes the session resident here (or, with ``suspended``, keeps it parked in host
        memory: ``state``'s tensors become its host copy, so they must be host tensors the
        caller hands over); its next chunk is ``state.seq``."""
        self.layout.check(state)
        if state.session_id in self._sessions:
            raise SessionAlreadyResident(state.session_id)
        if suspended:
            session = _Session(
                state.session_id,
                state.seed,
                state.prompt,
                state.seq,
                state.position,
                state.pending_prompt,
                input=state.input,
                strength=state.strength,
            )
            session.host = replace(state, meta=dict(state.meta))
            session.host_exported = True  # not ours to recycle
            self._sessions[state.session_id] = session
            self._open_input(session)
            return
        slot = self._claim_slot(arriving=state.session_id)
        held = self.reservations.held(state.session_id)
        if held is not None and self._in_slot(state, held):
            if held != slot:  # received straight into its reserved slot: into place
                self.pool.move(held, slot)
        else:
            self.pool.write(slot, state.layers, state.misc)
        self.reservations.release(state.session_id)
        session = _Session(
            state.session_id,
            state.seed,
            state.prompt,
            state.seq,
            state.position,
            state.pending_prompt,
            input=state.input,
            strength=state.strength,
        )
        self._sessions[state.session_id] = session
        self._open_input(session)
        self._resident.append(state.session_id)

    # -- recovery -------------------------------------------------------------------------
    def recovery_point(self, session_id: str) -> RecoveryPoint:
        """What :meth:`restore` needs to rebuild the session elsewhere; at a chunk boundary
        (right after the pass that completed a chunk)."""
        session = self._get(session_id)
        if session.phase:
            raise MidChunk(session_id, self.passes_to_boundary(session_id), "log")
        if session.host is not None:
            misc = session.host.misc
        else:
            slot = self._resident.index(session_id)
            misc = self.pool.misc[slot]
        history = misc[: self.pool.history_numel]
        raw = history.detach().to("cpu", copy=True).contiguous()
        return RecoveryPoint(
            session_id=session_id,
            seq=session.seq,
            position=session.position,
            prompt=session.prompt,
            pending_prompt=session.pending_prompt,
            seed=session.seed,
            preset=self.model_config.name,
            dtype=str(self.dtype).removeprefix("torch."),
            history=_tensor_bytes(raw),
            meta=self.layout.meta,
        )

    @torch.inference_mode()
    def restore(
        self,
        point: RecoveryPoint,
        *,
        input: SessionInput = SessionInput.TEXT,
        strength: float | None = None,
    ) -> None:
        """Rebuilds a session from its last recovery point: the clean latents go back into a
        slot, the prompt's cross-attention is encoded again, the self-attention cache is
        recomputed from the latents with the model's cache-writing pass (oldest chunk first, as
        on a prompt switch), and the decoder's state is rebuilt from the latents
        (``FrameDecoder.rebuild``: exact for the stand-in's two-frame context; for the Wan VAE,
        a decode of the window's frames from an empty cache). The session's next chunk is
        ``point.seq``.

        Not bitwise: each cached chunk's keys are recomputed seeing only the frames still in the
        window, where the originals saw the frames before them too (see docs/worker.md for the
        measured difference). A video session (``input``, at ``strength``) starts its frame
        encoder's cache from zeros: the input frames it was built from are not kept."""
        with _flush_denormals(self._device.type == "cpu"):
            ours = self.layout.meta
            if point.preset != self.model_config.name:
                raise IncompatibleState("preset", point.preset, self.model_config.name)
            if (
                point.meta.get("weights_seed") != ours["weights_seed"]
                or point.meta.get("checkpoint_digest") != ours["checkpoint_digest"]
            ):
                raise IncompatibleState("weights", point.meta, ours)
            history = _bytes_tensor(point.history, point.dtype)
            if history.numel() != self.pool.history_numel:
                raise IncompatibleState("history numel", history.numel(), self.pool.history_numel)
            if point.session_id in self._sessions:
                raise SessionAlreadyResident(point.session_id)
            slot = self._claim_slot()
            load, failure = len(self._resident) + 1, None
            try:
                self._rebuild(slot, point, history, input, strength)
            except torch.OutOfMemoryError as exc:
                failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if failure is not None:  # out of the handler: its traceback holds the tensors
                raise self._out_of_memory([point.session_id], failure, load)

    def _rebuild(
        self,
        slot: int,
        point: RecoveryPoint,
        history: torch.Tensor,
        input: SessionInput,
        strength: float | None,
    ) -> None:
        """``restore``'s work in ``slot``; the session is resident from its re-cache on, so an
        out-of-memory error there lets it go whole (``_out_of_memory``)."""
        self.pool.clear(slot)
        self.pool.misc[slot, : self.pool.history_numel].copy_(history.to(self._device, self.dtype))
        self._write_prompt(slot, self.prompts.get(point.prompt))
        session = _Session(
            point.session_id,
            point.seed,
            point.prompt,
            point.seq,
            point.position,
            point.pending_prompt,
            input=input,
            strength=strength,
        )
        self._sessions[point.session_id] = session
        self._open_input(session)
        self._resident.append(point.session_id)
        if session.position > 0:
            self._recache(slot, session)
            self.decoder.rebuild(
                self._recent_latents(slot, session), self.pool.decoder_state(slot, slot + 1)
            )

    # -- the pass ------------------------------------------------------------------------
    @torch.inference_mode()
    def pass_step(self, sessions: Collection[str] | None = None) -> list[ChunkResult]:
        """One batched model pass for every resident session (or only ``sessions``, a subset
        of them: the others keep their phase and sit this pass out), each at its own phase.

        A chunk's step count ``s`` is the budget in force at its first pass (phase 0). Phase
        0..s-1 is denoising step k of the session's chunk (its own noisy latent and timestep),
        phase s the cache-write pass of its clean chunk at t=0, after which its keys go into
        its cache, the chunk is decoded and returned here; the session then starts its next
        chunk at the next pass. A session added, resumed or imported starts at phase 0 at the
        next pass, so its first chunk comes ``s + 1`` passes later. A prompt change applies at
        the session's own chunk boundary. ``gen_ms`` of a result is the sum of its chunk's pass
        times; ``batch`` is the batch of the pass that completed it, ``steps`` its ``s``.

        A subset is moved to the front slots first (a few slot swaps), so the pass still reads
        plain slices of the slot buffers."""
        with _flush_denormals(self._device.type == "cpu"):
            self._admit_encoded()
            waiting = {
                sid
                for sid in self._resident
                if self._sessions[sid].awaiting_text or not self.input_ready(sid)
            }
            if waiting:  # out of this pass until their prompt is encoded
                chosen = self._resident if sessions is None else sessions
                sessions = [sid for sid in chosen if sid not in waiting]
            if self.config.max_decodes_per_pass is not None:
                sessions = self._bound_decodes(self._resident if sessions is None else sessions)
            count = self._front(sessions)
            if count == 0:
                return []
            started = time.perf_counter()
            batch = [self._sessions[sid] for sid in self._resident[:count]]
            failure = None
            try:
                self._apply_pending_prompts(batch)  # those at phase 0 only
                starts, caches = self._pass_inputs(batch)
                done, frames = self._pass(batch, starts, caches)
                frames_cpu = [f.contiguous().cpu() for f in frames]
                self._sync()
            except torch.OutOfMemoryError as exc:
                # Cleaned up once out of the handler: its traceback holds the pass's tensors.
                failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if failure is not None:
                raise self._out_of_memory([s.session_id for s in batch], failure, len(batch))
            pass_ms = (time.perf_counter() - started) * 1000.0
            self._pass_ms.setdefault(count, deque(maxlen=256)).append(pass_ms)
            for session in batch:
                if session.phase == 1:  # this was its chunk's first pass
                    session.chunk_ms, session.chunk_batch = 0.0, count
                elif session.chunk_batch != count:
                    session.chunk_batch = -1
                session.chunk_ms += pass_ms
            results = []
            for j, row in enumerate(done):
                session = batch[row]
                if session.chunk_batch == count and session.steps == self.full_steps:
                    # a whole chunk at one batch size and at full steps: telemetry
                    self._chunk_ms.setdefault(count, deque(maxlen=64)).append(session.chunk_ms)
                results.append(self._complete(session, frames_cpu[j], session.chunk_ms, count))
            for row in done:  # after the pass: suspending moves slots
                if batch[row].suspend_requested:
                    self._suspend_now(batch[row])
            return results

    def _pass_inputs(self, sessions: list[_Session]) -> tuple[torch.Tensor, ChunkCaches]:
        """The per-session positions and cache views of slots 0..n-1 (valid until a session's
        chunk completes: its position and cache fill change)."""
        config = self.model_config
        batch = len(sessions)
        starts = torch.tensor([s.position for s in sessions], dtype=torch.long)
        caches = ChunkCaches(
            self_kv=[self.pool.self_kv(i, 0, batch) for i in range(config.num_layers)],
            cross_kv=[self.pool.cross_kv(i, 0, batch) for i in range(config.num_layers)],
            key_mask=self._key_mask(sessions),
            scratch=self.pool.scratch,
        )
        return starts, caches

    def _pass(
        self, sessions: list[_Session], starts: torch.Tensor, caches: ChunkCaches
    ) -> tuple[list[int], list[torch.Tensor]]:
        """One batched model pass, every session at its own phase; advances the phases.

        Returns the rows whose chunk completed (cache-write pass, keys committed, decoded) and
        their frames on the device, ``[T, H, W, 3]`` each (a stream's first chunk may have
        fewer frames than the others: the Wan VAE decodes 9 for its 3 latent frames, then 12).
        The chunk in progress is the slot's ``pool.inflight`` row: noise x_t before a denoising
        pass, x0 before the cache-write pass. Rows are grouped by (step count, phase), so a
        lockstep batch runs the very same tensor ops as a single-phase batch, and a chunk at
        full steps the very same as without the quality budget."""
        batch = len(sessions)
        x = self.pool.inflight[:batch]
        starting = []
        for row, session in enumerate(sessions):
            if session.phase == 0:  # a new chunk: its levels are the budget's in force now
                session.levels = self._chunk_levels(session)
                session.steps = len(session.levels)
                starting.append(row)
        groups: dict[tuple[tuple[float, ...], int], list[int]] = {}
        for row, session in enumerate(sessions):
            groups.setdefault((session.levels, session.phase), []).append(row)
        if starting:
            self._start_chunks(x, sessions, starting)
        t = torch.tensor([_timestep(s) for s in sessions], device=self._device)
        flow = self.model(x, t, starts, caches).float()
        # 1. Denoising rows: x0 = x_t - sigma * flow, re-noised to the next level of the
        #    chunk's schedule with fresh noise (Self-Forcing's few-step sampler), or kept clean
        #    for the cache-write pass.
        for (levels, phase), rows in groups.items():
            steps = len(levels)
            if phase == steps:  # the cache-write pass
                continue
            index = _rows(rows)
            x0 = x[index] - levels[phase] * flow[index]
            if phase + 1 < steps:
                nxt = levels[phase + 1]
                noise = self._noise([sessions[r] for r in rows], phase + 1)
                x[index] = (1.0 - nxt) * x0 + nxt * noise
            else:
                x[index] = x0
        for session in sessions:
            session.phase += 1
        done = [row for row, session in enumerate(sessions) if session.phase > session.steps]
        if not done:
            return done, []
        # 2. Cache-write rows (their clean chunk ran at t=0): scratch -> sink or ring, clean
        #    latents -> history (for a later re-cache); then decode, the decoder's state in
        #    the slot advancing in place. A stream's first chunk decodes apart from the others
        #    (the Wan VAE starts it from an empty cache).
        index = _rows(done)
        clean = x[index]
        self._commit(done, [sessions[r].position for r in done], clean)
        state = self.pool.decoder_state(0, batch)
        frames: list[torch.Tensor] = [torch.empty(0)] * len(done)
        self._sync()
        started = time.perf_counter()
        for fresh in (True, False):
            group = [j for j, r in enumerate(done) if (sessions[r].position == 0) is fresh]
            if not group:
                continue
            rows = [done[j] for j in group]
            at = _rows(rows)
            latents = clean if len(group) == len(done) else clean[group]
            if isinstance(at, slice):
                out = self.decoder.decode(latents, state[at], fresh)
            else:
                gathered = state[at]
                out = self.decoder.decode(latents, gathered, fresh)
                state[at] = gathered
            for j, video in zip(group, out, strict=True):
                frames[j] = video
        self._sync()
        decode_ms = (time.perf_counter() - started) * 1000.0
        self._decode_ms.setdefault(len(done), deque(maxlen=64)).append(decode_ms)
        return done, frames

    def _chunk_levels(self, session: _Session) -> tuple[float, ...]:
        """The noise levels of the chunk the session starts: the step budget's sub-schedule;
        for a video session, the tail of the full schedule its strength keeps (diffusers'
        img2img rule: ``int(steps * strength)`` of the least noisy levels, none at strength 0,
        all at 1), thinned to the budget when that is shorter."""
        if session.input is not SessionInput.VIDEO:
            return self._schedules[self._steps]
        strength = DEFAULT_STRENGTH if session.strength is None else session.strength
        full = len(self._sigmas)
        count = min(full, int(full * strength + 1e-9))
        tail = self._sigmas[full - count :]
        if count > self._steps:
            tail = sub_schedule(tail, self._steps)
        return tuple(tail)

    def _start_chunks(self, x: torch.Tensor, sessions: list[_Session], rows: list[int]) -> None:
        """The starting latents of the chunks that begin in this pass (``rows`` of the batch):
        a text session's is noise from (seed, seq, 0); a video session's is its input chunk,
        encoded with the frame encoder's cache, noised to the chunk's first level with that
        same noise (at strength 0 the encoded input itself)."""
        text = [r for r in rows if sessions[r].input is not SessionInput.VIDEO]
        video = [r for r in rows if sessions[r].input is SessionInput.VIDEO]
        if text:
            x[_rows(text)] = self._noise([sessions[r] for r in text], 0)
        if not video:
            return
        encoded = self._encode_inputs(sessions, video)
        noise = self._noise([sessions[r] for r in video], 0)
        for j, row in enumerate(video):
            levels = sessions[row].levels
            if levels:
                x[row] = (1.0 - levels[0]) * encoded[j] + levels[0] * noise[j]
            else:
                x[row] = encoded[j]

    def _encode_inputs(self, sessions: list[_Session], rows: list[int]) -> torch.Tensor:
        """``[len(rows), C, F, h, w]`` float32: each video session's next input chunk (taken
        from its buffer) through the frame encoder, its state in the slot (row ``r`` is slot
        ``r`` in a pass) advancing in place; a stream's first chunk starts a fresh cache."""
        state = self.pool.encoder_state(0, len(sessions))
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        self._sync()
        started = time.perf_counter()
        for fresh in (True, False):
            group = [j for j, r in enumerate(rows) if (sessions[r].position == 0) is fresh]
            if not group:
                continue
            count = self.encoder.input_frames(fresh)
            frames = []
            for j in group:
                session = sessions[rows[j]]
                buffer = self.input_buffer(session.session_id)
                taken = buffer.take(count) if buffer is not None else None
                if taken is None:  # pass_step admits only sessions whose input is ready
                    raise RuntimeError(f"session {session.session_id}: input chunk not ready")
                frames.append(torch.as_tensor(np.stack(taken.frames)))
                session.input_seq = taken.last_seq
            batch = torch.stack(frames).to(self._device)
            at = _rows([rows[j] for j in group])
            if isinstance(at, slice):
                latents = self.encoder.encode(batch, state[at], fresh)
            else:
                gathered = state[at]
                latents = self.encoder.encode(batch, gathered, fresh)
                state[at] = gathered
            for j, z in zip(group, latents, strict=True):
                out[j] = z.float()
        self._sync()
        self._encode_ms.setdefault(len(rows), deque(maxlen=64)).append(
            (time.perf_counter() - started) * 1000.0
        )
        return torch.stack(out)

    def _sync(self) -> None:
        wait_for_stream(self._device)

    def _complete(
        self, session: _Session, frames: torch.Tensor, gen_ms: float, batch: int
    ) -> ChunkResult:
        result = ChunkResult(
            session.session_id,
            session.seq,
            frames,
            gen_ms,
            batch,
            session.steps,
            input_seq=session.input_seq,
        )
        session.seq += 1
        session.position += self.model_config.chunk_frames
        session.phase = 0
        return result

    def _noise(self, sessions: list[_Session], step: int) -> torch.Tensor:
        config = self.model_config
        shape = (config.in_dim, config.chunk_frames, config.latent_height, config.latent_width)
        return draw_noise(
            [noise_seed(s.seed, s.seq, step) for s in sessions], shape, self._generator
        ).to(self._device)

    def _frame_slot(self, position: int) -> int:
        """Where the chunk starting at latent frame ``position`` is kept in the cache."""
        config = self.model_config
        if position < config.sink_frames:
            return position
        return config.sink_frames + (position - config.sink_frames) % config.window_frames

    def _key_mask(self, sessions: list[_Session]) -> torch.Tensor | None:
        config = self.model_config
        sink, window = config.sink_frames, config.window_frames
        valid = torch.ones(len(sessions), config.cache_frames, dtype=torch.bool)
        for i, session in enumerate(sessions):
            written = session.position
            valid[i, :sink] = torch.arange(sink) < written
            valid[i, sink : sink + window] = torch.arange(window) < written - sink
        if bool(valid.all()):
            return None  # every session's window is full: unmasked (faster) attention
        tokens = valid.repeat_interleave(config.tokens_per_frame, dim=1)
        return tokens[:, None, None, :].to(self._device)

    def _commit(self, slots: list[int], positions: list[int], latents: torch.Tensor) -> None:
        """Scratch keys/values -> the chunk's frame slots, and its clean latents -> history,
        for the slots ``slots[i]`` whose chunks start at ``positions[i]``."""
        config = self.model_config
        tpf, frames = config.tokens_per_frame, config.chunk_frames
        start, end = self.pool.scratch
        for i, (slot, position) in enumerate(zip(slots, positions, strict=True)):
            frame = self._frame_slot(position)
            dst = frame * tpf
            for layer in range(config.num_layers):
                kv = self.pool.self_kv(layer, slot, slot + 1)[0]
                kv[:, :, dst : dst + end - start] = kv[:, :, start:end]
            self.pool.latent_history(slot, slot + 1)[0, :, frame : frame + frames] = latents[i]

    def _recache(self, slot: int, session: _Session) -> None:
        """LongLive's KV re-cache: recompute the cached frames' keys and values under the
        (already written) new prompt, oldest chunk first, each seeing only the frames
        recomputed before it, from the clean latents kept in the slot."""
        config = self.model_config
        chunk, sink, window = config.chunk_frames, config.sink_frames, config.window_frames
        oldest_ring = max(sink, session.position - window)
        starts = [p for p in range(0, session.position, chunk) if p < sink or p >= oldest_ring]
        history = self.pool.latent_history(slot, slot + 1)
        self_kv = [self.pool.self_kv(i, slot, slot + 1) for i in range(config.num_layers)]
        cross_kv = [self.pool.cross_kv(i, slot, slot + 1) for i in range(config.num_layers)]
        valid = torch.zeros(config.cache_frames, dtype=torch.bool)
        valid[sink + window :] = True  # the scratch
        for position in starts:
            frame = self._frame_slot(position)
            mask = valid.repeat_interleave(config.tokens_per_frame)[None, None, None, :]
            caches = ChunkCaches(self_kv, cross_kv, mask.to(self._device), self.pool.scratch)
            latents = history[:, :, frame : frame + chunk].clone()
            self.model(
                latents, torch.zeros(1, device=self._device), torch.tensor([position]), caches
            )
            self._commit([slot], [position], latents)
            valid[frame : frame + chunk] = True

    def _recent_latents(self, slot: int, session: _Session) -> torch.Tensor:
        """``[1, C, F, h, w]``: the latest run of consecutive frames the history still holds
        (the ring, and the sink when nothing was evicted after it), oldest first."""
        config = self.model_config
        sink, window = config.sink_frames, config.window_frames
        first = 0 if session.position <= sink + window else session.position - window
        history = self.pool.latent_history(slot, slot + 1)
        frames = [self._frame_slot(p) for p in range(first, session.position)]
        return history[:, :, frames]

    # -- helpers --------------------------------------------------------------------------
    def _get(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSession(session_id) from None

    def _claim_slot(self, arriving: str | None = None) -> int:
        """The next slot, ``len(resident)``; never a slot reserved for a handoff (but
        ``arriving``'s own)."""
        with self.reservations.lock:
            slot = len(self._resident)
            if slot >= self.capacity or slot >= self.reservations.ceiling(ignore=arriving):
                raise EngineFull(self.capacity)
            self.reservations.resident = slot + 1
        return slot

    def _in_slot(self, state: SessionSnapshot, slot: int) -> bool:
        """Whether ``state``'s tensors are the rows of ``slot`` (received into them)."""
        rows = self.pool.regions(slot)
        tensors = [*state.layers, state.misc]
        return len(rows) == len(tensors) and all(
            t.data_ptr() == r.data_ptr() and t.shape == r.shape
            for t, r in zip(tensors, rows, strict=True)
        )

    def _release_slot(self, session_id: str) -> None:
        """Frees the session's slot, moving the last resident session into the hole so that
        resident sessions stay in slots 0..n-1."""
        slot = self._resident.index(session_id)
        last = len(self._resident) - 1
        if slot != last:
            self.pool.move(last, slot)
            self._resident[slot] = self._resident[last]
        self._resident.pop()
        with self.reservations.lock:
            self.reservations.resident = len(self._resident)

    def _front(self, chosen: Collection[str] | None) -> int:
        """Moves the ``chosen`` resident sessions to slots ``0..m-1`` (all when None); returns
        m. Swaps only the slots that are out of place, in a deterministic order."""
        if chosen is None:
            return len(self._resident)
        wanted = set(chosen)
        unknown = wanted.difference(self._resident)
        if unknown:
            raise UnknownSession(sorted(unknown)[0])
        count = len(wanted)
        back = [i for i in range(count, len(self._resident)) if self._resident[i] in wanted]
        for slot in range(count):
            if self._resident[slot] not in wanted:
                other = back.pop(0)
                self.pool.swap(slot, other)
                res = self._resident
                res[slot], res[other] = res[other], res[slot]
        return count

    @torch.inference_mode()
    def _write_prompt(self, slot: int, embedding: torch.Tensor) -> None:
        text = embedding[None].to(self._device)
        for layer, kv in enumerate(self.model.encode_context(text)):
            self.pool.cross_kv(layer, slot, slot + 1).copy_(kv)

    def wait_for_prompts(self) -> None:
        """Blocks until every prompt a session waits for (its first, or a change) is encoded,
        so the next pass takes them all. For benches and tests that want a known batch; the
        worker never waits (a session sits out until its prompt is there)."""
        for session in self._sessions.values():
            if session.awaiting_text:
                self.prompts.get(session.prompt)
            if session.pending_prompt is not None:
                self.prompts.get(session.pending_prompt)

    def _admit_encoded(self) -> None:
        """Sessions waiting for their first prompt's embedding join once it is there."""
        for slot, sid in enumerate(self._resident):
            session = self._sessions[sid]
            if not session.awaiting_text:
                continue
            embedding = self.prompts.ready(session.prompt)
            if embedding is not None:
                self._write_prompt(slot, embedding)
                session.awaiting_text = False

    def _apply_pending_prompts(self, sessions: list[_Session]) -> None:
        """Switches prompts at chunk boundaries: only sessions at phase 0 (slot = index), once
        the new prompt is encoded."""
        for slot, session in enumerate(sessions):
            if session.pending_prompt is not None and session.phase == 0:
                prompt = session.pending_prompt
                embedding = self.prompts.ready(prompt)
                if embedding is None:
                    continue  # still encoding: this chunk keeps the old prompt
                started = time.perf_counter()
                self._write_prompt(slot, embedding)
                if self.prompt_recache == "kv" and session.position > 0:
                    self._recache(slot, session)
                self._switch_ms.append((time.perf_counter() - started) * 1000.0)
                session.prompt, session.pending_prompt = prompt, None

    def _recycle_host(self, session: _Session) -> None:
        host, session.host = session.host, None
        if host is None or session.host_exported:
            return
        if len(self._spare_host) < self.config.spare_host_buffers:
            self._spare_host.append([*host.layers, host.misc])
        elif self._pin:
            # Freed, not cached: the host allocator keeps page-locked blocks until told.
            del host
            torch.accelerator.empty_host_cache()

    def _read_state(
        self, session: _Session, into: list[torch.Tensor] | None = None, on_device: bool = False
    ) -> SessionSnapshot:
        slot = self._resident.index(session.session_id)
        if session.awaiting_text:  # its state must hold its prompt before it leaves
            self._write_prompt(slot, self.prompts.get(session.prompt))
            session.awaiting_text = False
        layers = None
        if on_device:
            try:
                layers, misc = self.pool.clone(slot)
            except torch.OutOfMemoryError:
                # No room for a clone: the host copy (the handoff then goes by gloo).
                log.warning("freeze_clone_out_of_memory", session_id=session.session_id)
                memory.free_device_memory(self._device)
        if layers is None:
            layers, misc = self.pool.read(slot, pin=self._pin, into=into)
        return SessionSnapshot(
            session_id=session.session_id,
            seq=session.seq,
            position=session.position,
            prompt=session.prompt,
            seed=session.seed,
            preset=self.model_config.name,
            dtype=str(self.dtype).removeprefix("torch."),
            layers=layers,
            misc=misc,
            pending_prompt=session.pending_prompt,
            meta=self.layout.meta,
            input=session.input,
            strength=session.strength,
        )

    # -- telemetry ------------------------------------------------------------------------
    def chunk_ms_by_batch(self) -> dict[int, float]:
        """Median measured wall time of a chunk, per batch size seen: the chunks at full steps
        whose passes all ran at one batch size (the sum of their pass times)."""
        samples = list(self._chunk_ms.items())
        return {b: statistics.median(list(ms)) for b, ms in sorted(samples) if ms}

    def prompt_switch_ms(self) -> float | None:
        """Median time a prompt switch added to its pass (the cross-attention written and, with
        the KV re-cache, the cached frames recomputed)."""
        samples = list(self._switch_ms)
        return statistics.median(samples) if samples else None

    def forget_decode_times(self) -> None:
        """Start :meth:`decode_ms_by_batch` afresh (a bench's warm-up passes are not counted)."""
        self._decode_ms.clear()

    def encode_ms_by_batch(self) -> dict[int, float]:
        """Median wall time of the frame encoder per number of input chunks it encoded in a
        pass (part of the chunk time of a video session)."""
        samples = list(self._encode_ms.items())
        return {b: statistics.median(list(ms)) for b, ms in sorted(samples) if ms}

    def decode_ms_by_batch(self) -> dict[int, float]:
        """Median wall time of the frame decoder per number of chunks it decoded in a pass
        (part of the chunk time)."""
        samples = list(self._decode_ms.items())
        return {b: statistics.median(list(ms)) for b, ms in sorted(samples) if ms}

    def pass_ms_by_batch(self) -> dict[int, float]:
        """Median measured wall time of one ``pass_step`` pass, per batch size seen."""
        samples = list(self._pass_ms.items())
        return {b: statistics.median(list(ms)) for b, ms in sorted(samples) if ms}

    def telemetry(self) -> dict[str, Any]:
        """Device report plus engine figures (for benches; the worker reports its own)."""
        report = telemetry_mod.device_report(self._device)
        sessions = list(self._sessions.values())
        report.update(
            preset=self.model_config.name,
            capacity=self.capacity,
            active=len(self._resident),
            suspended=sum(1 for s in sessions if s.suspended),
            state_bytes=self.state_bytes,
            chunk_ms=self.chunk_ms_by_batch(),
            pass_ms=self.pass_ms_by_batch(),
            decode_ms=self.decode_ms_by_batch(),
            encode_ms=self.encode_ms_by_batch(),
            passes_per_chunk=self.passes_per_chunk,
            steps=self._steps,
            full_steps=self.full_steps,
            min_steps=self._min_steps,
            text_encode_ms=self.prompts.encode_ms(),
            prompt_switch_ms=self.prompt_switch_ms(),
            model=dict(self.sources),
        )
        return report


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU tensor's raw bytes (any dtype, bfloat16 included)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _bytes_tensor(data: bytes, dtype: str) -> torch.Tensor:
    """The inverse of :func:`_tensor_bytes`."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(_DTYPES[dtype])


def _timestep(session: _Session) -> float:
    """The timestep of the session's pass: its level's, or 0 for the cache-write pass."""
    if session.phase < len(session.levels):
        return session.levels[session.phase] * 1000.0
    return 0.0


def _rows(rows: list[int]) -> slice | list[int]:
    """An index for ``rows`` (ascending): a slice (a view, no copy) when they are contiguous,
    as every row of a single-phase batch is, else the list (a gather)."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return rows


def next_chunks(engine: Engine) -> list[ChunkResult]:
    """One chunk of every resident session: waits for the prompts they wait for, then runs
    passes until each has completed one, whatever its phase and step count. A session whose
    chunk is done keeps taking passes unless that would complete another one before the
    others are done, so sessions in phase stay in phase (at one step count, every session
    takes all ``steps + 1`` passes). For benches, tests and tools that want whole chunks; the
    worker drives ``pass_step`` itself, pass by pass."""
    engine.wait_for_prompts()
    # A video session whose input chunk is not there yet owes nothing (it sits out).
    owed = {sid for sid in engine.active_sessions() if engine.input_ready(sid)}
    passes = max((_passes_for_chunk(engine, sid) for sid in owed), default=0)
    results: list[ChunkResult] = []
    for left in range(passes, 0, -1):
        chosen = [
            sid
            for sid in engine.active_sessions()
            if sid in owed or _passes_for_chunk(engine, sid) > left
        ]
        done = engine.pass_step(chosen)
        results.extend(r for r in done if r.session_id in owed)
        owed.difference_update(r.session_id for r in done)
    while owed:  # chunks whose decode a bound on decodes per pass put off
        done = engine.pass_step([sid for sid in engine.active_sessions() if sid in owed])
        results.extend(r for r in done if r.session_id in owed)
        owed.difference_update(r.session_id for r in done)
    return results


def _passes_for_chunk(engine: Engine, session_id: str) -> int:
    """Passes until the session completes a chunk: its chunk in progress, or a whole one at
    the budget in force."""
    return engine.passes_to_boundary(session_id) or engine.steps + 1

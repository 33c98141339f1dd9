"""Preallocated per-session state slots.

Each layer owns one buffer ``[capacity, region]``; a session's region in it (one row) holds
its self-attention cache ``[2, H, cache_tokens, d]`` followed by its cross-attention cache
``[2, H, text_len, d]``, contiguous, so the migration transport can send it whole. A second
buffer (``misc``) holds the clean latents of the cached frames, the frame decoder's causal
state (two latent frames for the stand-in; the Wan VAE's feature cache for the real one) and the
frame encoder's (a video session's input: none for the stand-in; the Wan VAE encoder's feature
cache for the real one). Resident sessions always occupy slots
``0..n-1`` (the engine compacts on removal), so a batched pass reads plain slices of the
buffers and never gathers (a copy of every cache per pass).

Frame slots of the self-attention cache: ``[sink | ring window | scratch]``. The scratch
holds the current chunk's keys and values during its passes; the cache-write pass copies
them into the sink (first chunk) or the ring (later chunks, overwriting the oldest). The
misc region keeps the clean latents of the cached frames (in the same frame slots), from which
a prompt switch recomputes the cache, then the decoder's state.

A third buffer, ``inflight`` ``[capacity, C, F, h, w]`` (float32), holds each resident
session's chunk in progress under pass-level admission (``Engine.pass_step``): its noisy
latent during denoising passes, its clean latent before the cache-write pass. It moves with
the slot but is not part of the session's state (a session is suspended or exported only at a
chunk boundary, where it holds nothing).
"""

from __future__ import annotations

import threading

import torch

from ..model.config import ModelConfig


def wait_for_stream(device: torch.device) -> None:
    """Wait for the work queued on this thread's current stream of ``device`` (nothing on the
    CPU), not the whole device: the text encoder's stream runs on (``model/text.py``)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class SlotPool:
    def __init__(
        self,
        config: ModelConfig,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
        decoder_state_numel: int,
        encoder_state_numel: int = 0,
    ) -> None:
        self.config = config
        self.capacity = capacity
        self.device = device
        self.dtype = dtype
        heads, head_dim = config.num_heads, config.head_dim
        self.cache_tokens = config.cache_frames * config.tokens_per_frame
        self.self_shape = (2, heads, self.cache_tokens, head_dim)
        self.cross_shape = (2, heads, config.text_len, head_dim)
        self.self_numel = 2 * heads * self.cache_tokens * head_dim
        self.region_numel = self.self_numel + 2 * heads * config.text_len * head_dim
        latent = (config.latent_height, config.latent_width)
        # Clean latents of the frames in the KV cache (same frame slots), for the re-cache and
        # for recovery; then the frame decoder's causal state.
        self.history_shape = (config.out_dim, config.sink_frames + config.window_frames, *latent)
        self.history_numel = int(torch.Size(self.history_shape).numel())
        self.decoder_numel = decoder_state_numel
        self.encoder_numel = encoder_state_numel
        self.misc_numel = self.history_numel + decoder_state_numel + encoder_state_numel
        self.layers = [
            torch.zeros(capacity, self.region_numel, device=device, dtype=dtype)
            for _ in range(config.num_layers)
        ]
        self.misc = torch.zeros(capacity, self.misc_numel, device=device, dtype=dtype)
        chunk = (config.in_dim, config.chunk_frames, *latent)
        self.inflight = torch.zeros(capacity, *chunk, device=device, dtype=torch.float32)

    @property
    def bytes_per_slot(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return (self.region_numel * self.config.num_layers + self.misc_numel) * item

    @property
    def memory_per_slot(self) -> int:
        """What one slot takes: its state and its chunk in progress (``inflight``). A pool of
        capacity 0 allocates nothing, so this is known before any slot exists."""
        inflight = int(torch.Size(self.inflight.shape[1:]).numel()) * 4  # float32
        return self.bytes_per_slot + inflight

    @property
    def scratch(self) -> tuple[int, int]:
        config = self.config
        start = (config.sink_frames + config.window_frames) * config.tokens_per_frame
        return start, start + config.chunk_tokens

    def self_kv(self, layer: int, start: int, end: int) -> torch.Tensor:
        rows = self.layers[layer][start:end, : self.self_numel]
        return rows.view(end - start, *self.self_shape)

    def cross_kv(self, layer: int, start: int, end: int) -> torch.Tensor:
        rows = self.layers[layer][start:end, self.self_numel :]
        return rows.view(end - start, *self.cross_shape)

    def decoder_state(self, start: int, end: int) -> torch.Tensor:
        """Rows ``[n, decoder_numel]`` (views) of the decoder's per-session state."""
        return self.misc[start:end, self.history_numel : self.history_numel + self.decoder_numel]

    def encoder_state(self, start: int, end: int) -> torch.Tensor:
        """Rows ``[n, encoder_numel]`` (views) of the frame encoder's per-session state."""
        return self.misc[start:end, self.history_numel + self.decoder_numel :]

    def latent_history(self, start: int, end: int) -> torch.Tensor:
        rows = self.misc[start:end, : self.history_numel]
        return rows.view(end - start, *self.history_shape)

    def clear(self, slot: int) -> None:
        for buffer in self.layers:
            buffer[slot].zero_()
        self.misc[slot].zero_()

    def move(self, src: int, dst: int) -> None:
        for buffer in self.layers:
            buffer[dst].copy_(buffer[src])
        self.misc[dst].copy_(self.misc[src])
        self.inflight[dst].copy_(self.inflight[src])

    def swap(self, a: int, b: int) -> None:
        """Exchanges two slots' contents (state and chunk in progress)."""
        for buffer in [*self.layers, self.misc, self.inflight]:
            held = buffer[a].clone()
            buffer[a].copy_(buffer[b])
            buffer[b].copy_(held)

    def regions(self, slot: int) -> list[torch.Tensor]:
        """The slot's contiguous regions (views): one per layer, then the misc one."""
        return [buffer[slot] for buffer in self.layers] + [self.misc[slot]]

    def host_buffers(self, pin: bool) -> list[torch.Tensor]:
        """Empty host tensors shaped like one slot's regions (page-locked when ``pin``).

        Never inference tensors, even when allocated inside ``torch.inference_mode`` (a
        suspend deferred to the end of ``Engine.pass_step``): they are recycled and written
        again by suspends outside it."""
        with torch.inference_mode(False):
            return [
                torch.empty(region.shape, dtype=region.dtype, pin_memory=pin)
                for region in self.regions(0)
            ]

    def read(
        self, slot: int, pin: bool, into: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """A host copy of the slot, complete when it returns; ``into`` reuses buffers from
        ``host_buffers`` (allocating page-locked memory costs far more than the copy)."""
        copies = into if into is not None else self.host_buffers(pin)
        for region, host in zip(self.regions(slot), copies, strict=True):
            host.copy_(region, non_blocking=host.is_pinned())
        wait_for_stream(self.device)
        return copies[:-1], copies[-1]

    def clone(self, slot: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """A copy of the slot on its own device (the regions' clones, not views: slots move
        when sessions leave, and a view would change under a transfer). One slot's worth of
        device memory until the copy is dropped; complete when it returns."""
        copies = [region.clone() for region in self.regions(slot)]
        wait_for_stream(self.device)
        return copies[:-1], copies[-1]

    def write(self, slot: int, layers: list[torch.Tensor], misc: torch.Tensor) -> None:
        for region, source in zip(self.regions(slot), [*layers, misc], strict=True):
            region.copy_(source, non_blocking=source.is_pinned())
        wait_for_stream(self.device)


class SlotReservations:
    """Slots held for sessions arriving by a handoff, which are received straight into them
    (no second copy, no fresh buffers). Thread-safe, unlike the rest of the engine: the event
    loop reserves and releases, the generation thread claims slots and adopts.

    Resident sessions keep slots ``0..n-1``, so a reservation takes the highest free slot at
    or above ``resident`` (the slots claimed so far), and a claim is refused at the lowest
    reserved slot: neither ever touches the other's rows."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        self.resident = 0  # slots claimed by resident sessions (kept by the engine, under lock)
        self._held: dict[str, int] = {}

    def reserve(self, session_id: str) -> list[torch.Tensor] | None:
        """The rows of a slot held for ``session_id`` (one per layer, then misc), or None when
        every free slot is taken."""
        with self.lock:
            slot = self._held.get(session_id)
            if slot is None:
                taken = set(self._held.values())
                free = [i for i in range(self.resident, self.pool.capacity) if i not in taken]
                if not free:
                    return None
                slot = self._held[session_id] = max(free)
        return self.pool.regions(slot)

    def held(self, session_id: str) -> int | None:
        with self.lock:
            return self._held.get(session_id)

    def release(self, session_id: str) -> None:
        with self.lock:
            self._held.pop(session_id, None)

    def ceiling(self, ignore: str | None = None) -> int:
        """(Under ``lock``.) The first slot a claim may not take."""
        slots = [slot for sid, slot in self._held.items() if sid != ignore]
        return min(slots, default=self.pool.capacity)

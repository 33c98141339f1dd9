"""The engine's memory budget: how many session slots fit, decided before one is allocated.

Slots are preallocated at full size (``slots.py``), so a worker that takes more sessions than
its device holds fails at the first busy pass, not at start. The budget is::

    sessions * slot + decodes * decode_peak + slot + margin <= available

- ``slot``: one session's state and its chunk in progress (``SlotPool.slot_bytes``);
- ``decode_peak``: what one chunk's decode allocates on top (diffusers builds the Wan VAE's
  activations afresh on every decode): measured once at start on CUDA, estimated on the CPU;
- ``decodes``: the decodes one pass may run (``EngineConfig.max_decodes_per_pass``; without a
  bound, every session's);
- one more ``slot``: a handoff's clone on the device (a freeze for NCCL or CUDA IPC; a state
  arriving is received into a free slot instead, ``SlotReservations``);
- ``margin``: a share of what is available, for the DiT pass's activations and the allocator's
  fragmentation (not measured yet);
- ``available``: free device memory after the weights are loaded (``torch.cuda.mem_get_info``),
  or the host's available memory (``/proc/meminfo``) on the CPU.

:func:`plan` is pure; the probes around it read the device.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shared.profile import DEFAULT_PROFILE, load_profile
from shared.settings import DEFAULT_SLOTS, WorkerSettings, parse_resolution

from .types import EngineError

MARGIN = 0.10  # of what is available: the pass's activations and fragmentation (see above)
_MEMINFO = Path("/proc/meminfo")


class MemoryBudgetExceeded(EngineError):
    """The sessions asked for (or a single one) do not fit in what the device has; names the
    numbers. Retrying does not help: lower the sessions, the resolution or the decodes per
    pass, or free the device."""

    def __init__(self, sessions: int, needed: int, available: int, budget: MemoryBudget) -> None:
        super().__init__(
            f"{sessions} session(s) need {human(needed)} ({human(budget.slot_bytes)} a slot, "
            f"{budget.decodes_for(sessions)} decode(s) of {human(budget.decode_peak)} a pass, "
            f"one slot for a handoff, a {MARGIN:.0%} margin); {human(available)} is available "
            f"on {budget.where}"
        )
        self.sessions = sessions
        self.needed = needed
        self.available = available
        self.budget = budget


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    where: str  # the device, as in messages
    available: int
    slot_bytes: int
    decode_peak: int  # one chunk's decode, on top of the slots
    decode_measured: bool  # measured (CUDA) or estimated (CPU)
    max_decodes: int | None  # per pass; None: every session's
    sessions: int = 0  # what the budget gives (set by ``plan``)

    def decodes_for(self, sessions: int) -> int:
        return sessions if self.max_decodes is None else min(self.max_decodes, sessions)

    def needed(self, sessions: int) -> int:
        reserve = self.decodes_for(sessions) * self.decode_peak + self.slot_bytes
        return sessions * self.slot_bytes + reserve + int(MARGIN * self.available)

    def fits(self, sessions: int) -> bool:
        return self.needed(sessions) <= self.available


def plan(budget: MemoryBudget, asked: int | None, ceiling: int) -> MemoryBudget:
    """``budget`` with its ``sessions``: ``asked`` if it fits (else :class:`MemoryBudgetExceeded`
    naming the numbers), or without it the most up to ``ceiling`` that fit (at least one)."""
    if asked is not None:
        if not budget.fits(asked):
            raise MemoryBudgetExceeded(asked, budget.needed(asked), budget.available, budget)
        return _with(budget, asked)
    for sessions in range(ceiling, 0, -1):
        if budget.fits(sessions):
            return _with(budget, sessions)
    raise MemoryBudgetExceeded(1, budget.needed(1), budget.available, budget)


def _with(budget: MemoryBudget, sessions: int) -> MemoryBudget:
    return MemoryBudget(
        budget.where,
        budget.available,
        budget.slot_bytes,
        budget.decode_peak,
        budget.decode_measured,
        budget.max_decodes,
        sessions,
    )


def estimated_decode_peak(state_bytes: int, frame_bytes: int) -> int:
    """What one chunk's decode allocates, without a device to measure it on: four times its
    decoder state and its frames in float32 (the Wan VAE rebuilds its cache and upsamples in
    float activations; a worker on CUDA measures it instead)."""
    return 4 * (state_bytes + frame_bytes)


def available_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now: CUDA's free memory, or the host's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def host_available_bytes(meminfo: Path = _MEMINFO) -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (what the kernel could give without swapping)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable in {meminfo}")


def free_device_memory(device: torch.device) -> None:
    """After an out-of-memory error: drop what Python still holds, and give the allocator's
    cached blocks back (CUDA) so the next pass starts from what the slots take."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} GiB"


# A worker's interpreter with torch and its service imported, before the model (measured on
# the CPU: about 250 MiB resident).
PROCESS_BYTES = 256 << 20


def cpu_pool_shortfall(workers: int, settings: WorkerSettings, emulate: str) -> str:
    """Why ``workers`` CPU workers of these settings cannot all fit in this host's available
    memory ('' when they can): each takes its process, the stand-in's weights, its slots (the
    sessions it will take), a decode's peak per decode and a slot for a handoff. Only the
    stand-ins are sized here (a model folder's weights are not read before start)."""
    if workers < 1 or settings.model or settings.checkpoint:
        return ""
    from ..model.config import get_preset
    from ..model.decoder import LatentDecoder
    from ..model.dit import CausalWanModel
    from .slots import SlotPool

    config = get_preset(settings.preset)
    if settings.resolution and (size := parse_resolution(settings.resolution)):
        config = replace(config, height=size[0], width=size[1])
    sessions = settings.max_sessions
    if sessions is None and emulate:
        sessions = load_profile(settings.emulate_profile or DEFAULT_PROFILE).capacity
    sessions = sessions or DEFAULT_SLOTS
    item = 4  # float32 on the CPU
    with torch.device("meta"):
        dit, decoder = CausalWanModel(config), LatentDecoder(config)
        slot = SlotPool(config, 0, torch.device("meta"), torch.float32, decoder.state_numel)
    weights = sum(p.numel() for p in [*dit.parameters(), *decoder.parameters()]) * item
    frames = config.video_frames_per_chunk * config.height * config.width * 3 * 4
    peak = estimated_decode_peak(decoder.state_numel * item, frames)
    decodes = sessions if settings.max_decodes_per_pass is None else settings.max_decodes_per_pass
    per_worker = PROCESS_BYTES + weights + (sessions + 1) * slot.memory_per_slot
    per_worker += min(decodes, sessions) * peak
    available = host_available_bytes()
    if workers * per_worker + int(MARGIN * available) <= available:
        return ""
    return (
        f"{workers} CPU worker(s) of {sessions} session(s) of {settings.preset} at "
        f"{config.height}x{config.width} need {human(workers * per_worker)} "
        f"({human(per_worker)} each: {human(slot.memory_per_slot)} a slot), and this host has "
        f"{human(available)} available; start fewer workers (--workers), or set "
        "TURBOSERVE_MAX_SESSIONS, TURBOSERVE_RESOLUTION or TURBOSERVE_MAX_DECODES_PER_PASS lower"
    )

"""A :class:`~.host.StateHost` over plain tensors, for the tests and ``bench migration``.

A session's state is ``layers`` equal tensors plus a small ``misc`` one, filled from its seed;
``advance`` plays one chunk: a deterministic change of the state and ``seq + 1``. So the state
a session must have after any number of chunks, wherever they ran, is known
(:func:`expected_state`), and a test can check that a session moved back and forth is intact
bit for bit. ``preset`` is ``synthetic``; the meta names the layout, which admission checks
against the tensors offered. Sessions may have different layouts (the benchmark moves several
sizes between one pair of processes): ``add`` takes one, or uses the host's default.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from services.gpu_worker.engine.types import SessionSnapshot
from services.gpu_worker.handoff.codes import HandoffCode
from services.gpu_worker.handoff.host import FrozenSession, HandoffRefusal, HostRefused

PRESET = "synthetic"
MISC_NUMEL = 64


@dataclass(frozen=True, slots=True)
class Layout:
    """A state of ``nbytes`` (rounded down to whole elements) in ``layers`` tensors."""

    nbytes: int
    layers: int = 4
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.layer_numel < 1:
            raise ValueError(f"{self.nbytes} bytes is too small for {self.layers} layers")

    @property
    def layer_numel(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return (self.nbytes - MISC_NUMEL * item) // (item * self.layers)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def key(self) -> str:
        return layout_key([self.layer_numel] * self.layers, self.dtype_name)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``bytes=N layers=K`` (how a synthetic session's ASSIGN prompt names its layout)."""
        fields = dict(part.partition("=")[::2] for part in text.split())
        try:
            return cls(nbytes=int(fields["bytes"]), layers=int(fields.get("layers", 4)))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not a synthetic layout (bytes=N layers=K): {text!r}") from exc

    def describe(self) -> str:
        return f"bytes={self.nbytes} layers={self.layers}"


def layout_key(layer_numels: list[int], dtype: str) -> str:
    return f"{'x'.join(map(str, layer_numels))}+{MISC_NUMEL}:{dtype}"


@dataclass(slots=True)
class _Held:
    layers: list[torch.Tensor]
    misc: torch.Tensor
    layout_key: str
    seed: int
    seq: int  # wire seq of the next chunk
    epoch: int
    prompt: str
    suspended: bool = False
    frozen: bool = False
    produced: list[int] = field(default_factory=list)  # the seqs this host generated


def initial_state(layout: Layout, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(layout.layer_numel, generator=gen) for _ in range(layout.layers)]
    tensors.append(torch.randn(MISC_NUMEL, generator=gen))
    return [t.to(layout.dtype) for t in tensors]


def play_chunk(tensors: list[torch.Tensor], seq: int) -> None:
    """The change chunk ``seq`` makes to a state (in place, on any device)."""
    layer = tensors[seq % (len(tensors) - 1)]
    layer[(seq * 7919) % layer.numel()] += seq + 1
    tensors[-1][seq % MISC_NUMEL] += 1


def expected_state(layout: Layout, seed: int, chunks: int) -> list[torch.Tensor]:
    tensors = initial_state(layout, seed)
    for seq in range(chunks):
        play_chunk(tensors, seq)
    return tensors


class SyntheticHost:
    def __init__(
        self,
        worker_id: str,
        layout: Layout,
        *,
        device: str = "cpu",
        capacity: int = 8,
        freeze_delay_s: float = 0.0,
    ) -> None:
        self.worker_id = worker_id
        self.layout = layout
        self.device = device
        self.capacity = capacity
        self.freeze_delay_s = freeze_delay_s  # stands in for waiting for a chunk boundary
        # Held by whoever plays a chunk until its progress is recorded, as the worker's
        # generation thread is until its chunks are delivered: a freeze waits for it, so a
        # session is never handed off between a chunk and its record.
        self.chunk_boundary = asyncio.Lock()
        self.draining = False
        self.sessions: dict[str, _Held] = {}
        self.reserved: set[str] = set()
        self.released: list[str] = []
        # State memory of sessions that left, by (layout, device): received into again.
        self.spare: dict[tuple[str, str], list[list[torch.Tensor]]] = {}

    # -- what a worker does with its own sessions ------------------------------------------
    def add(
        self,
        session_id: str,
        seed: int,
        epoch: int,
        prompt: str = "",
        *,
        layout: Layout | None = None,
        suspended: bool = False,
    ) -> None:
        layout = layout or self.layout
        tensors = initial_state(layout, seed)
        where = "cpu" if suspended else self.device
        tensors = [t.to(where) for t in tensors]
        self.sessions[session_id] = _Held(
            tensors[:-1], tensors[-1], layout.key, seed, 0, epoch, prompt, suspended=suspended
        )

    def advance(self, session_id: str) -> int | None:
        """Play one chunk of an executing, unfrozen session; returns its seq (None if the
        session cannot play now)."""
        held = self.sessions.get(session_id)
        if held is None or held.frozen or held.suspended:
            return None
        seq = held.seq
        play_chunk([*held.layers, held.misc], seq)
        held.seq += 1
        held.produced.append(seq)
        return seq

    def state(self, session_id: str) -> list[torch.Tensor]:
        held = self.sessions[session_id]
        return [t.cpu() for t in (*held.layers, held.misc)]

    # -- StateHost --------------------------------------------------------------------------
    async def freeze(self, session_id: str, epoch: int, *, on_device: bool) -> FrozenSession:
        held = self.sessions.get(session_id)
        if held is None:
            raise HostRefused(HandoffCode.UNKNOWN_SESSION, f"{self.worker_id} does not hold it")
        if held.epoch != epoch:
            raise HostRefused(HandoffCode.STALE_EPOCH, f"held at epoch {held.epoch}, not {epoch}")
        if held.frozen:
            raise HostRefused(HandoffCode.BUSY, "already being handed off")
        if self.freeze_delay_s:
            await asyncio.sleep(self.freeze_delay_s)
        async with self.chunk_boundary:
            if held.frozen:
                raise HostRefused(HandoffCode.BUSY, "already being handed off")
            held.frozen = True
        tensors = [*held.layers, held.misc]
        if not on_device:
            tensors = [t.cpu() for t in tensors]
        snapshot = SessionSnapshot(
            session_id=session_id,
            seq=held.seq,
            position=held.seq,
            prompt=held.prompt,
            seed=held.seed,
            preset=PRESET,
            dtype=str(held.misc.dtype).removeprefix("torch."),
            layers=tensors[:-1],
            misc=tensors[-1],
            meta={"layout": held.layout_key},
        )
        return FrozenSession(
            snapshot, next_seq=held.seq, due_at=time.time(), suspended=held.suspended
        )

    async def unfreeze(self, session_id: str, epoch: int) -> None:
        held = self.sessions[session_id]
        held.frozen = False
        held.epoch = epoch

    async def release(self, session_id: str) -> None:
        held = self.sessions.pop(session_id, None)
        self.released.append(session_id)
        if held is not None:
            tensors = [*held.layers, held.misc]
            self.spare.setdefault((held.layout_key, str(held.misc.device)), []).append(tensors)

    def receive_buffers(self, incoming: FrozenSession, device: str) -> list[torch.Tensor] | None:
        snap = incoming.snapshot
        spares = self.spare.get((snap.meta.get("layout", ""), device))
        return spares.pop() if spares else None

    def admission(self, incoming: FrozenSession) -> HandoffRefusal | None:
        snap = incoming.snapshot
        if self.draining:
            return HandoffRefusal(HandoffCode.DRAINING, f"{self.worker_id} is draining")
        if snap.session_id in self.sessions or snap.session_id in self.reserved:
            return HandoffRefusal(HandoffCode.EXISTS, f"{self.worker_id} already holds it")
        if len(self.sessions) + len(self.reserved) >= self.capacity:
            return HandoffRefusal(HandoffCode.FULL, f"all {self.capacity} slots are taken")
        offered = layout_key([t.numel() for t in snap.layers], snap.dtype)
        if (
            snap.preset != PRESET
            or snap.meta.get("layout") != offered
            or snap.misc.numel() != MISC_NUMEL
        ):
            return HandoffRefusal(
                HandoffCode.INCOMPATIBLE,
                f"a {snap.preset} state laid out as {snap.meta.get('layout')}, "
                f"its tensors say {offered}",
            )
        return None

    def reserve(self, session_id: str) -> None:
        self.reserved.add(session_id)

    def unreserve(self, session_id: str) -> None:
        self.reserved.discard(session_id)

    async def adopt(self, frozen: FrozenSession, epoch: int) -> None:
        snap = frozen.snapshot
        where = "cpu" if frozen.suspended else self.device
        tensors = [t.to(where) for t in (*snap.layers, snap.misc)]
        self.reserved.discard(snap.session_id)
        self.sessions[snap.session_id] = _Held(
            tensors[:-1],
            tensors[-1],
            snap.meta["layout"],
            snap.seed,
            frozen.next_seq,
            epoch,
            snap.prompt,
            suspended=frozen.suspended,
        )

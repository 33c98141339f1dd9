"""A session's state as a list of tensors on the wire: specs, checks, the keyed checksum (no
network I/O).

The tensor list of a snapshot is its per-layer regions followed by ``misc``; the offer
describes each by a :class:`~shared.wire.TensorSpec`, and the destination allocates exactly
those before a byte moves.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from concurrent.futures import ThreadPoolExecutor

import torch

from shared.wire import HandoffOffer, TensorSpec

from ..engine.types import SessionSnapshot
from .host import FrozenSession

# A transfer owns TAGS_PER_TRANSFER consecutive tags: one per tensor, the last for the
# receiver's acknowledgement. Transfer tags stay below 2**31.
TAGS_PER_TRANSFER = 1024
MAX_TENSORS = TAGS_PER_TRANSFER - 1
SECRET_BYTES = 32  # an offer's one-time key
_BLOCK_BYTES = 8 << 20  # a leaf of the checksum's tree: hashed on its own, in parallel
_HASH_THREADS = min(8, os.cpu_count() or 1)
_DOMAIN = b"turboserve handoff state v1\0"


class BadSpec(ValueError):
    """An offer whose tensor specs cannot be right; names the fault."""

    retryable = False


class VerificationFailed(ValueError):
    """Received state that differs from what the offer announced; names what differs."""

    retryable = False


def tensors_of(snapshot: SessionSnapshot) -> list[torch.Tensor]:
    return [*snapshot.layers, snapshot.misc]


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise BadSpec(f"unknown dtype {name!r}")
    return dtype


def spec_nbytes(spec: TensorSpec) -> int:
    if any(d < 0 for d in spec.shape):
        raise BadSpec(f"negative dimension in shape {spec.shape}")
    numel = 1
    for d in spec.shape:
        numel *= d
    return numel * dtype_of(spec.dtype).itemsize


def check_specs(specs: list[TensorSpec], nbytes: int) -> None:
    """The offer's specs are usable and add up to its ``nbytes``; :class:`BadSpec` if not."""
    if not 1 <= len(specs) <= MAX_TENSORS:
        raise BadSpec(f"{len(specs)} tensors; a state has 1 to {MAX_TENSORS}")
    total = sum(spec_nbytes(s) for s in specs)
    if total != nbytes:
        raise BadSpec(f"the tensor specs add up to {total} bytes, the offer says {nbytes}")


def allocate(specs: list[TensorSpec], device: str | torch.device) -> list[torch.Tensor]:
    return [torch.empty(s.shape, dtype=dtype_of(s.dtype), device=device) for s in specs]


def buffers(
    specs: list[TensorSpec], device: torch.device, into: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """``into`` when it is exactly what ``specs`` describe (contiguous, on ``device``), else
    new tensors."""
    if (
        into is not None
        and len(into) == len(specs)
        and all(
            spec_of(t) == s and t.is_contiguous() and t.device == device
            for t, s in zip(into, specs, strict=True)
        )
    ):
        return into
    return allocate(specs, device)


def new_secret() -> str:
    """An offer's one-time secret (hex): the key of its checksum, never used for another."""
    return secrets.token_hex(SECRET_BYTES)


def digest_context(transfer_id: str, session_id: str, epoch: int, src: str, dst: str) -> bytes:
    """What a checksum is bound to besides the bytes: the transfer, the session at its
    migrating epoch, and both workers. State checksummed for one offer fits no other."""
    return f"{transfer_id}\0{session_id}\0{epoch}\0{src}\0{dst}".encode()


def checksum(tensors: list[torch.Tensor], secret: str, context: bytes) -> str:
    """HMAC-SHA256 under ``secret`` (hex) of ``context`` and the tensors: each one's dtype and
    shape, then the SHA-256 of each of its 8 MiB blocks in order. The blocks are hashed in
    parallel threads (hashlib lets go of the GIL), at several GB/s on a GPU host's cores; a
    device tensor's blocks are copied to the host one at a time to be hashed. Only who holds
    the secret can make a checksum the destination accepts, and no byte, dtype, shape or
    order can change without changing it. Raises ``ValueError`` for a malformed secret."""
    key = bytes.fromhex(secret)
    if len(key) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes, this one {len(key)}")
    flats = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    blocks = [
        (i, start) for i, flat in enumerate(flats) for start in range(0, flat.numel(), _BLOCK_BYTES)
    ]

    def leaf(block: tuple[int, int]) -> bytes:
        i, start = block
        part = flats[i][start : start + _BLOCK_BYTES]
        return hashlib.sha256(part.cpu().numpy().data).digest()

    if len(blocks) > 1 and _HASH_THREADS > 1:
        with ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="checksum") as pool:
            leaves = list(pool.map(leaf, blocks))
    else:
        leaves = [leaf(b) for b in blocks]
    mac = hmac.new(key, _DOMAIN + context, "sha256")
    at = 0
    for i, t in enumerate(tensors):
        mac.update(f";{i}:{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}:".encode())
        while at < len(blocks) and blocks[at][0] == i:
            mac.update(leaves[at])
            at += 1
    return mac.hexdigest()


def verify(tensors: list[torch.Tensor], specs: list[TensorSpec], nbytes: int) -> None:
    """The tensors are the offer's layout; raises :class:`VerificationFailed` naming the
    first difference."""
    if len(tensors) != len(specs):
        raise VerificationFailed(f"{len(tensors)} tensors received, {len(specs)} offered")
    for i, (t, s) in enumerate(zip(tensors, specs, strict=True)):
        got = spec_of(t)
        if got != s:
            raise VerificationFailed(
                f"tensor {i} is {got.dtype}{got.shape}, the offer said {s.dtype}{s.shape}"
            )
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total != nbytes:
        raise VerificationFailed(f"{total} bytes received, {nbytes} offered")


def verify_checksum(tensors: list[torch.Tensor], offer: HandoffOffer) -> None:
    """What arrived is what the offer's author checksummed under the offer's secret: raises
    :class:`VerificationFailed` for tampered bytes, or a secret that is not the one the
    checksum was made with (a pass over every byte: run it off the event loop)."""
    context = digest_context(offer.transfer_id, offer.session_id, offer.epoch, offer.src, offer.dst)
    got = checksum(tensors, offer.secret, context)
    if not hmac.compare_digest(got, offer.checksum):
        raise VerificationFailed(
            "checksum differs from the offer's: the bytes were changed on the way, or the "
            "offer's secret is not the one they were checksummed with"
        )


def frozen_from(offer: HandoffOffer, tensors: list[torch.Tensor]) -> FrozenSession:
    """The session as the destination adopts it (``tensors``: regions, then misc)."""
    snapshot = SessionSnapshot(
        session_id=offer.session_id,
        seq=offer.engine_seq,
        position=offer.position,
        prompt=offer.prompt,
        seed=offer.seed,
        preset=offer.preset,
        dtype=offer.dtype,
        layers=tensors[:-1],
        misc=tensors[-1],
        pending_prompt=offer.pending_prompt,
        meta=dict(offer.meta),
        input=offer.input,
        strength=offer.strength,
    )
    return FrozenSession(
        snapshot, next_seq=offer.next_seq, due_at=offer.due_at, suspended=offer.suspended
    )


def skeleton(offer: HandoffOffer) -> FrozenSession:
    """The offered session with ``meta``-device tensors: shapes and dtypes, no bytes (for
    ``StateHost.admission``). The specs must have passed :func:`check_specs`."""
    return frozen_from(offer, allocate(offer.tensors, "meta"))

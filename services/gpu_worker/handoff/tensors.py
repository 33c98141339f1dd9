"""A session's state as a list of tensors on the wire: specs, checks, checksum (no I/O).

The tensor list of a snapshot is its per-layer regions followed by ``misc``; the offer
describes each by a :class:`~shared.wire.TensorSpec`, and the destination allocates exactly
those before a byte moves.
"""

from __future__ import annotations

import hashlib

import torch

from shared.wire import HandoffOffer, TensorSpec

from ..engine.types import SessionSnapshot
from .host import FrozenSession

# A transfer owns TAGS_PER_TRANSFER consecutive tags: one per tensor, the last for the
# receiver's acknowledgement. Transfer tags stay below 2**31.
TAGS_PER_TRANSFER = 1024
MAX_TENSORS = TAGS_PER_TRANSFER - 1
_DIGEST_BYTES = 16


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


def checksum(tensors: list[torch.Tensor]) -> str:
    """blake2b of the tensors' bytes in order, with their shapes and dtypes (device tensors
    are copied to the host: meant for tests and audits, not the fast path)."""
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for t in tensors:
        digest.update(f"{t.dtype}{tuple(t.shape)};".encode())
        host = t.detach().contiguous().cpu()
        if host.numel():
            digest.update(host.view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def verify(
    tensors: list[torch.Tensor], specs: list[TensorSpec], nbytes: int, expected_checksum: str = ""
) -> None:
    """Raises :class:`VerificationFailed` naming the first difference."""
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
    if expected_checksum:
        got_sum = checksum(tensors)
        if got_sum != expected_checksum:
            raise VerificationFailed(f"checksum {got_sum} != offered {expected_checksum}")


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

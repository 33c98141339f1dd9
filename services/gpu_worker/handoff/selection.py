"""Which transport moves a session's state: a pure function of where the state is and where
it goes (no torch, no I/O), so that every case is unit-tested without a GPU.

- State in host memory (a suspended session, or a CPU worker) moves host to host: ``gloo``.
- State on a CUDA device going to another process on the *same* physical GPU (same device
  UUID): ``cuda_ipc``. NCCL refuses two ranks on one GPU, and a device-to-device copy through
  an IPC handle is the fastest path anyway.
- State on a CUDA device going to another GPU: ``nccl``.
- State on a CUDA device going to a CPU worker, or a GPU whose UUID is unknown: ``gloo`` (the
  sender copies to host memory first).

Either side may force a transport (``TURBOSERVE_HANDOFF_TRANSPORT``); a forced transport that
cannot carry this state, or two sides forcing different ones, is a refusal (:class:`NoTransport`).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
GLOO = "gloo"
NCCL = "nccl"
CUDA_IPC = "cuda_ipc"
TRANSPORTS = (GLOO, NCCL, CUDA_IPC)


class NoTransport(ValueError):
    """No transport can carry this state between these two sides; says why."""

    retryable = False


@dataclass(frozen=True, slots=True)
class Place:
    """Where tensors are: ``device`` is ``cpu`` or ``cuda:N``; ``uuid`` the GPU's UUID (the
    same physical GPU has the same UUID in every process, whatever its index there)."""

    device: str = "cpu"
    uuid: str = ""

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def select_transport(state: Place, dst: Place, src_asks: str = AUTO, dst_asks: str = AUTO) -> str:
    """The transport for moving state held at ``state`` to a worker whose device is ``dst``.

    ``src_asks``/``dst_asks``: each side's setting, ``auto`` or a transport name."""
    for side, asked in (("source", src_asks), ("destination", dst_asks)):
        if asked != AUTO and asked not in TRANSPORTS:
            raise NoTransport(f"the {side} asks for unknown transport {asked!r}")
    if src_asks != AUTO and dst_asks != AUTO and src_asks != dst_asks:
        raise NoTransport(f"the source forces {src_asks}, the destination {dst_asks}")
    forced = src_asks if src_asks != AUTO else dst_asks
    if forced != AUTO:
        problem = _unfit(forced, state, dst)
        if problem:
            raise NoTransport(f"{forced} is forced but {problem}")
        return forced
    if not (state.on_cuda and dst.on_cuda and state.uuid and dst.uuid):
        return GLOO
    return CUDA_IPC if state.uuid == dst.uuid else NCCL


def _unfit(transport: str, state: Place, dst: Place) -> str:
    """Why ``transport`` cannot carry this state ('' when it can)."""
    if transport == GLOO:
        return ""
    if not state.on_cuda:
        return f"the state is in host memory ({state.device})"
    if not dst.on_cuda:
        return f"the destination has no CUDA device ({dst.device})"
    if not (state.uuid and dst.uuid):
        return "a GPU's UUID is unknown"
    same = state.uuid == dst.uuid
    if transport == NCCL and same:
        return f"both sides are on the same GPU ({state.uuid}); NCCL needs two devices"
    if transport == CUDA_IPC and not same:
        return f"the sides are on different GPUs ({state.uuid}, {dst.uuid})"
    return ""

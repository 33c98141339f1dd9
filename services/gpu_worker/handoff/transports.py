"""Point-to-point transports for a session's state tensors.

A transport builds a communicator for a link (:mod:`.rendezvous`: rank 0 sends, rank 1
receives) and moves a list of tensors over it. Every method blocks and takes an absolute
deadline (``time.monotonic()``); the endpoint runs them in its threads. A transport that
fails raises :class:`TransferError`, and the endpoint then tears the link down on its side
(the peer sees the connection close and tears down its own).

- :class:`GlooTransport`: ``ProcessGroupGloo`` over TCP, host tensors (device tensors are
  copied to the host first). One ``send``/``recv`` per tensor, all posted at once, each with
  its own tag (``tag + index``); then the receiver acknowledges with one byte. A gloo send
  completes once its bytes are in the kernel's socket buffers, several MiB before the
  receiver has them: without the acknowledgement that tail (and for a small state the whole
  transfer) would be timed as part of the commit.
- :class:`NcclTransport`: ``ProcessGroupNCCL`` between two CUDA devices, tensors received
  straight into device memory.
- :class:`CudaIpcTransport`: two processes on one GPU. The sender shares CUDA IPC handles of
  its frozen tensors through the link's store; the receiver opens them, copies device to
  device into its own memory, and writes ``done``; the sender waits for it.

Other transports (NIXL, UCX) fit the same four methods.
"""

from __future__ import annotations

import base64
import os
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, ClassVar

import orjson
import torch

# torch.distributed re-exports it without declaring it; its stub lives here.
from torch._C._distributed_c10d import Store

from shared.wire import TensorSpec

from .selection import CUDA_IPC, GLOO, NCCL
from .tensors import TAGS_PER_TRANSFER, buffers

_WARMUP_TAG = (1 << 31) - 1  # above every transfer's tags
_POLL_S = 0.0005


class TransferError(RuntimeError):
    """The transport could not move the state (peer gone, timeout, backend error)."""

    retryable = True


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError("the handoff deadline passed")
    return left


class Transport(ABC):
    name: ClassVar[str]

    @abstractmethod
    def connect(self, store: Store, rank: int, device: torch.device, deadline: float) -> Any:
        """Build the link's communicator (both ranks call it at once); returns its handle."""

    @abstractmethod
    def send(self, handle: Any, tensors: list[torch.Tensor], tag: int, deadline: float) -> None:
        """Rank 0: move ``tensors``; returns when the receiver has them."""

    @abstractmethod
    def recv(
        self,
        handle: Any,
        specs: list[TensorSpec],
        tag: int,
        device: torch.device,
        deadline: float,
        into: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Rank 1: receive tensors shaped as ``specs`` (into ``into`` when it fits them)."""

    def close(self, handle: Any) -> None:  # noqa: B027 - a transport without a communicator
        """Tear the communicator down (the peer's pending operations fail), as far as the
        backend can while this process still holds references to it."""


class GlooTransport(Transport):
    name = GLOO

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname

    def connect(self, store: Store, rank: int, device: torch.device, deadline: float) -> Any:
        from torch.distributed import ProcessGroupGloo

        timeout = timedelta(seconds=remaining(deadline))
        options_type = getattr(ProcessGroupGloo, "_Options", None)
        try:
            if options_type is None:  # the documented constructor: the default interface
                group = ProcessGroupGloo(store, rank, 2, timeout)
            else:
                # Options are the only way to bind gloo to the advertised address (the
                # documented constructor picks an interface from the machine's hostname, or
                # GLOO_SOCKET_IFNAME); torch 2.13 exposes them as ``_Options`` only.
                options = options_type()
                options._timeout = timeout
                options._devices = [ProcessGroupGloo.create_device(hostname=self.hostname)]
                group = ProcessGroupGloo(store, rank, 2, options)
            _warm_up(group, rank, torch.zeros(1, dtype=torch.uint8), deadline)
        except RuntimeError as exc:
            raise TransferError(f"gloo link: {exc}") from exc
        return group

    def send(self, handle: Any, tensors: list[torch.Tensor], tag: int, deadline: float) -> None:
        host = [t.detach().contiguous().cpu() for t in tensors]
        ack = torch.zeros(1, dtype=torch.uint8)
        try:
            works = [handle.send([t], 1, tag + i) for i, t in enumerate(host) if t.numel()]
            works.append(handle.recv([ack], 1, _ack_tag(tag)))
            for work in works:
                work.wait(timedelta(seconds=remaining(deadline)))
        except RuntimeError as exc:
            raise TransferError(f"gloo send: {exc}") from exc

    def recv(
        self,
        handle: Any,
        specs: list[TensorSpec],
        tag: int,
        device: torch.device,
        deadline: float,
        into: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        out = buffers(specs, torch.device("cpu"), into)
        try:
            works = [handle.recv([t], 0, tag + i) for i, t in enumerate(out) if t.numel()]
            for work in works:
                work.wait(timedelta(seconds=remaining(deadline)))
            handle.send([torch.ones(1, dtype=torch.uint8)], 0, _ack_tag(tag)).wait(
                timedelta(seconds=remaining(deadline))
            )
        except RuntimeError as exc:
            raise TransferError(f"gloo recv: {exc}") from exc
        return out

    def close(self, handle: Any) -> None:
        # Nothing to call: gloo's abort() leaves the connections open (measured). They close
        # when the communicator is freed, once the link and any call still blocked on it (it
        # ends by its deadline) let go of it; the peer then sees "connection closed".
        del handle


class NcclTransport(Transport):
    """Needs a CUDA build of torch with NCCL and two different GPUs."""

    name = NCCL

    def __init__(self) -> None:
        # A NCCL error or timeout must fail one handoff, not kill the worker: the default
        # error handling tears the whole process down.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")

    def connect(self, store: Store, rank: int, device: torch.device, deadline: float) -> Any:
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(device)
        try:
            options = ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timedelta(seconds=remaining(deadline))
            group = ProcessGroupNCCL(store, rank, 2, options)
            # A first tiny transfer creates the NCCL communicator now, so that its cost is
            # the first use's and not the first handoff's.
            _warm_up(group, rank, torch.zeros(1, dtype=torch.uint8, device=device), deadline)
        except RuntimeError as exc:
            raise TransferError(f"nccl link: {exc}") from exc
        return group

    def send(self, handle: Any, tensors: list[torch.Tensor], tag: int, deadline: float) -> None:
        device = next((t.device for t in tensors if t.is_cuda), None)
        if device is None:
            raise TransferError("nccl sends device tensors; this state is in host memory")
        torch.cuda.set_device(device)
        ready = [t.detach().to(device).contiguous() for t in tensors]
        try:
            works = [handle.send([t], 1, tag + i) for i, t in enumerate(ready) if t.numel()]
            _wait_device(handle, works, device, deadline)
        except RuntimeError as exc:
            raise TransferError(f"nccl send: {exc}") from exc

    def recv(
        self,
        handle: Any,
        specs: list[TensorSpec],
        tag: int,
        device: torch.device,
        deadline: float,
        into: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        torch.cuda.set_device(device)
        out = buffers(specs, device, into)
        try:
            works = [handle.recv([t], 0, tag + i) for i, t in enumerate(out) if t.numel()]
            _wait_device(handle, works, device, deadline)
        except RuntimeError as exc:
            raise TransferError(f"nccl recv: {exc}") from exc
        return out

    def close(self, handle: Any) -> None:
        handle.abort()


class CudaIpcTransport(Transport):
    """Both processes on one physical GPU: the link is just the sender's store."""

    name = CUDA_IPC

    def connect(self, store: Store, rank: int, device: torch.device, deadline: float) -> Any:
        return store

    def send(self, handle: Any, tensors: list[torch.Tensor], tag: int, deadline: float) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        store: Store = handle
        key = f"ipc/{tag}"
        shared = [t.detach().contiguous() for t in tensors]
        if shared:
            torch.cuda.synchronize(shared[0].device)  # the receiver reads what is written
        try:
            payload = encode_ipc([reduce_tensor(t)[1] for t in shared])  # type: ignore[no-untyped-call]
            store.set(key, payload.decode())
            store.wait([f"{key}/done"], timedelta(seconds=remaining(deadline)))
            done = store.get(f"{key}/done")
        except RuntimeError as exc:
            raise TransferError(f"cuda_ipc send: {exc}") from exc
        finally:
            for k in (key, f"{key}/done"):
                try:
                    store.delete_key(k)
                except RuntimeError:
                    pass  # the store is gone with its peer: nothing left to clean
        if done != b"ok":
            raise TransferError(f"cuda_ipc: the receiver failed: {done.decode(errors='replace')}")
        # The receiver has copied and closed its handles: free what the IPC kept alive now,
        # not at some later allocation.
        del shared
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    def recv(
        self,
        handle: Any,
        specs: list[TensorSpec],
        tag: int,
        device: torch.device,
        deadline: float,
        into: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        store: Store = handle
        key = f"ipc/{tag}"
        try:
            store.wait([key], timedelta(seconds=remaining(deadline)))
            entries = decode_ipc(store.get(key))
        except (RuntimeError, ValueError) as exc:
            raise TransferError(f"cuda_ipc handles: {exc}") from exc
        try:
            torch.cuda.set_device(device)
            out = buffers(specs, device, into)
            if len(entries) != len(out):
                raise TransferError(f"{len(entries)} IPC handles for {len(out)} tensors")
            for target, entry in zip(out, entries, strict=True):
                # The sender's device index may name another GPU here (other visible devices);
                # the UUIDs matched, so the GPU is ours: open the handle on our index.
                source = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
                    torch.Tensor,
                    entry["size"],
                    entry["stride"],
                    entry["offset"],
                    torch.storage.TypedStorage,
                    entry["dtype"],
                    device.index,
                    *entry["share"],
                )
                target.copy_(source)
                del source
            torch.cuda.synchronize(device)
        except (RuntimeError, TransferError) as exc:
            _quietly(store.set, f"{key}/done", f"error: {exc}"[:500])
            raise TransferError(f"cuda_ipc copy: {exc}") from exc
        store.set(f"{key}/done", "ok")
        return out


def make_transport(name: str, hostname: str) -> Transport:
    if name == GLOO:
        return GlooTransport(hostname)
    if name == NCCL:
        return NcclTransport()
    if name == CUDA_IPC:
        return CudaIpcTransport()
    raise ValueError(f"unknown transport {name!r}")


# -- helpers --------------------------------------------------------------------------------


def _ack_tag(tag: int) -> int:
    return tag + TAGS_PER_TRANSFER - 1


def _warm_up(group: Any, rank: int, buf: torch.Tensor, deadline: float) -> None:
    op = group.send if rank == 0 else group.recv
    work = op([buf], 1 - rank, _WARMUP_TAG)
    if buf.is_cuda:
        _wait_device(group, [work], buf.device, deadline)
    else:
        work.wait(timedelta(seconds=remaining(deadline)))


def _wait_device(group: Any, works: list[Any], device: torch.device, deadline: float) -> None:
    """Wait for NCCL work from the host with our own deadline (NCCL's own wait only orders
    streams); past it, abort the communicator so that nothing stays queued on the GPU."""
    while not all(w.is_completed() for w in works):
        if time.monotonic() > deadline:
            _quietly(group.abort)
            raise TransferError("the handoff deadline passed during a NCCL transfer")
        time.sleep(_POLL_S)
    for work in works:
        work.wait()  # raises the communicator's error, if any
    torch.cuda.synchronize(device)


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except RuntimeError:
        pass  # best effort on a path that is already failing


def encode_ipc(shares: list[tuple[Any, ...]]) -> bytes:
    """The arguments of ``reduce_tensor`` for CUDA tensors as JSON (never pickle: the store
    is a network service, and a pickle from it could run code)."""
    entries = []
    for args in shares:
        (_cls, size, stride, offset, _storage_cls, dtype, _device, *share) = args
        entries.append(
            {
                "size": list(size),
                "stride": list(stride),
                "offset": int(offset),
                "dtype": str(dtype).removeprefix("torch."),
                "share": [_encode_value(v) for v in share],
            }
        )
    return orjson.dumps(entries)


def decode_ipc(payload: bytes) -> list[dict[str, Any]]:
    from .tensors import dtype_of

    entries = orjson.loads(payload)
    if not isinstance(entries, list):
        raise ValueError("IPC payload is not a list")
    out = []
    for entry in entries:
        out.append(
            {
                "size": torch.Size(entry["size"]),
                "stride": tuple(entry["stride"]),
                "offset": int(entry["offset"]),
                "dtype": dtype_of(entry["dtype"]),
                "share": [_decode_value(v) for v in entry["share"]],
            }
        )
    return out


def _encode_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ValueError(f"cannot encode an IPC share field of type {type(value).__name__}")


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        return base64.b64decode(value["b64"])
    return value

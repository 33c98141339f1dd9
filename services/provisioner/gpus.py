"""The GPUs of this host, for the local backend: one worker each, pinned by UUID.

``TURBOSERVE_GPUS=auto`` asks nvidia-ml-py (NVML) for every GPU; on a GPU in MIG mode each MIG
instance counts as one GPU (CUDA_VISIBLE_DEVICES takes ``MIG-<uuid>`` too). Where NVML is
missing or finds nothing, the host has no GPU and the pool runs CPU workers. ``none`` forces CPU
workers; a comma-separated list names the GPUs (UUIDs or indices) to hand out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.logging import get_logger

log = get_logger("turboserve.provisioner")


@dataclass(frozen=True, slots=True)
class GpuDevice:
    uuid: str  # what CUDA_VISIBLE_DEVICES gets: GPU-..., MIG-..., or an index
    name: str = ""

    def __str__(self) -> str:
        return f"{self.uuid} ({self.name})" if self.name else self.uuid


def discover(spec: str, nvml: Any = None) -> list[GpuDevice]:
    """The GPUs ``spec`` (the ``gpus`` setting) names; ``nvml`` replaces the pynvml module."""
    if spec == "none":
        return []
    if spec != "auto":
        return [GpuDevice(entry.strip()) for entry in spec.split(",") if entry.strip()]
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            log.info("no_gpu", reason="nvidia-ml-py is not installed")
            return []
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:  # LibraryNotFound, DriverNotLoaded, ...
        log.info("no_gpu", reason=f"NVML: {type(exc).__name__}")
        return []
    try:
        return _nvml_gpus(nvml)
    finally:
        nvml.nvmlShutdown()


def _nvml_gpus(nvml: Any) -> list[GpuDevice]:
    gpus: list[GpuDevice] = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(handle))
        migs = _mig_instances(nvml, handle)
        if migs:
            gpus += [GpuDevice(uuid, f"{name} MIG") for uuid in migs]
        else:
            gpus.append(GpuDevice(_text(nvml.nvmlDeviceGetUUID(handle)), name))
    return gpus


def _mig_instances(nvml: Any, handle: Any) -> list[str]:
    """The UUIDs of the MIG instances of a GPU in MIG mode (empty otherwise)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # NotSupported: a GPU without MIG
        return []
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return []
    uuids = []
    for managed in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, managed)
        except nvml.NVMLError:  # NotFound: an empty MIG slot
            continue
        uuids.append(_text(nvml.nvmlDeviceGetUUID(mig)))
    return uuids


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

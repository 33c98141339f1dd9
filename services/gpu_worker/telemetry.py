"""Device telemetry for heartbeats: NVML (nvidia-ml-py) on a GPU, a clear CPU mode otherwise.

Every report has ``mode`` ("gpu" or "cpu"), ``device``, ``mem_total_bytes`` and
``mem_free_bytes`` (host RAM in CPU mode); on a GPU also ``util_percent``. NVML is optional at run time: when it cannot be loaded the report
falls back to what torch knows and says so in ``source``.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def describe(device: torch.device) -> str:
    """One human line for a worker's first log line."""
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)} ({device})"
    return f"no GPU: running on the CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def device_report(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return _gpu_report(device)
    return _cpu_report()


def _cpu_report() -> dict[str, Any]:
    page = os.sysconf("SC_PAGE_SIZE")
    return {
        "mode": "cpu",
        "device": "cpu",
        "name": "cpu",
        "source": "os",
        "mem_total_bytes": os.sysconf("SC_PHYS_PAGES") * page,
        "mem_free_bytes": os.sysconf("SC_AVPHYS_PAGES") * page,
        "util_percent": None,
        "threads": torch.get_num_threads(),
    }


def _gpu_report(device: torch.device) -> dict[str, Any]:
    report: dict[str, Any] = {
        "mode": "gpu",
        "device": str(device),
        "name": torch.cuda.get_device_name(device),
        "torch_allocated": torch.cuda.memory_allocated(device),
        "torch_reserved": torch.cuda.memory_reserved(device),
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = _nvml_handle(pynvml, device)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            report.update(
                source="nvml",
                mem_total_bytes=int(memory.total),
                mem_free_bytes=int(memory.free),
            )
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(handle)
                report.update(util_percent=int(util.gpu), mem_util_percent=int(util.memory))
            except pynvml.NVMLError:  # e.g. not supported on a MIG instance
                report.update(util_percent=None, mem_util_percent=None)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML missing or refused (e.g. in some containers)
        free, total = torch.cuda.mem_get_info(device)
        report.update(
            source=f"torch (nvml unavailable: {type(exc).__name__})",
            mem_total_bytes=total,
            mem_free_bytes=free,
            util_percent=None,
        )
    return report


def _nvml_handle(pynvml: Any, device: torch.device) -> Any:
    """The NVML handle of the GPU torch calls ``device``.

    NVML numbers every GPU of the machine while torch numbers the visible ones, and
    CUDA_VISIBLE_DEVICES may name them by index, UUID (``GPU-...``, possibly a prefix) or MIG
    id (``MIG-...``). So look the device up by the UUID CUDA reports for it first, then by a
    full UUID written in CUDA_VISIBLE_DEVICES, and only then by index."""
    for uuid in _uuid_candidates(device):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            continue
    return pynvml.nvmlDeviceGetHandleByIndex(_physical_index(device))


def _uuid_candidates(device: torch.device) -> list[str]:
    """NVML UUIDs to try for ``device``, best first (may be empty)."""
    candidates: list[str] = []
    try:
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    except Exception:  # no CUDA, or an old torch
        uuid = None
    if uuid is not None:
        candidates += nvml_uuids(str(uuid))
    entry = _visible_entry(device)
    if entry is not None and _is_full_uuid(entry) and entry not in candidates:
        candidates.append(entry)
    return candidates


def nvml_uuids(cuda_uuid: str) -> list[str]:
    """NVML's spellings of a UUID as torch prints it (``xxxxxxxx-xxxx-...``, no prefix): a
    whole GPU is ``GPU-<uuid>``, a MIG instance ``MIG-<uuid>`` (R470+ drivers)."""
    text = cuda_uuid.strip()
    for prefix in ("GPU-", "MIG-"):
        if text.startswith(prefix):
            return [text]
    if not text or text.strip("0-") == "":  # empty or all zeros: CUDA did not say
        return []
    return [f"GPU-{text}", f"MIG-{text}"]


def _is_full_uuid(entry: str) -> bool:
    """A complete ``GPU-``/``MIG-`` UUID (36 characters after the prefix), not a prefix of one
    (CUDA accepts those; NVML does not)."""
    return entry[:4] in ("GPU-", "MIG-") and len(entry) == 40 and entry.count("-") == 5


def _visible_entry(device: torch.device) -> str | None:
    """The CUDA_VISIBLE_DEVICES entry that torch's ``device`` is, if the variable is set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return None
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    index = device.index or 0
    return entries[index] if index < len(entries) else None


def _physical_index(device: torch.device) -> int:
    """NVML counts all GPUs; CUDA_VISIBLE_DEVICES renumbers them for torch. The fallback when
    no UUID lookup worked: right for index lists, a guess (torch's index) otherwise."""
    entry = _visible_entry(device)
    if entry is not None and entry.isdigit():
        return int(entry)
    return device.index or 0

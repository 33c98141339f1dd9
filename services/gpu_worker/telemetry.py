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
            handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(device))
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            report.update(
                source="nvml", mem_total_bytes=int(memory.total), mem_free_bytes=int(memory.free),
                util_percent=int(util.gpu), mem_util_percent=int(util.memory),
            )
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML missing or refused (e.g. in some containers)
        free, total = torch.cuda.mem_get_info(device)
        report.update(
            source=f"torch (nvml unavailable: {type(exc).__name__})",
            mem_total_bytes=total, mem_free_bytes=free, util_percent=None,
        )
    return report


def _physical_index(device: torch.device) -> int:
    """NVML counts all GPUs; CUDA_VISIBLE_DEVICES renumbers them for torch."""
    index = device.index or 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(entries) and entries[index].isdigit():
            return int(entries[index])
    return index

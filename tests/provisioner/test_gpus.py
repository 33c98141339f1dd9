"""GPU discovery for the local backend. NVML cannot run on this CPU host: the real pynvml fails
to load here (checked below), and a small stand-in with NVML's calls checks the enumeration."""

from __future__ import annotations

import pytest

from services.provisioner.gpus import GpuDevice, discover


class NVMLError(Exception):
    pass


class FakeNvml:
    """NVML's calls as the discovery uses them; ``migs``: per GPU index, its MIG UUIDs (None:
    a GPU without MIG support)."""

    NVMLError = NVMLError
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(
        self,
        gpus: list[tuple[str, bytes]],
        migs: dict[int, list[str | None]] | None = None,
        fail_init: bool = False,
    ) -> None:
        self.gpus = gpus
        self.migs = migs or {}
        self.fail_init = fail_init
        self.shut_down = False

    def nvmlInit(self):
        if self.fail_init:
            raise NVMLError("driver not loaded")

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetName(self, handle):
        return self.gpus[handle[1]][1]

    def nvmlDeviceGetUUID(self, handle):
        if handle[0] == "mig":
            return self.migs[handle[1]][handle[2]]
        return self.gpus[handle[1]][0]

    def nvmlDeviceGetMigMode(self, handle):
        if handle[1] not in self.migs:
            raise NVMLError("not supported")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return len(self.migs[handle[1]])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, managed):
        if self.migs[handle[1]][managed] is None:
            raise NVMLError("not found")
        return ("mig", handle[1], managed)


def test_every_gpu_by_uuid_and_mig_instances_as_gpus():
    nvml = FakeNvml(
        [("GPU-1111", b"NVIDIA H200"), ("GPU-2222", "NVIDIA A100")],
        migs={1: ["MIG-aaaa", None, "MIG-bbbb"]},
    )
    assert discover("auto", nvml) == [
        GpuDevice("GPU-1111", "NVIDIA H200"),
        GpuDevice("MIG-aaaa", "NVIDIA A100 MIG"),
        GpuDevice("MIG-bbbb", "NVIDIA A100 MIG"),
    ]
    assert nvml.shut_down


def test_no_driver_means_no_gpu():
    assert discover("auto", FakeNvml([], fail_init=True)) == []
    assert discover("auto", FakeNvml([])) == []


def test_this_host_has_no_gpu_for_the_real_nvml():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert discover("auto") == []
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this host has NVML: the discovery runs for real in the device check")


def test_named_gpus_and_none():
    assert discover("none", FakeNvml([("GPU-1", b"x")])) == []
    assert discover("GPU-aaaa, 3,MIG-x") == [
        GpuDevice("GPU-aaaa"),
        GpuDevice("3"),
        GpuDevice("MIG-x"),
    ]
    assert str(GpuDevice("GPU-1", "H200")) == "GPU-1 (H200)" and str(GpuDevice("3")) == "3"

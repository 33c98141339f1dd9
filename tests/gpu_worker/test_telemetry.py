"""NVML device lookup under CUDA_VISIBLE_DEVICES (no GPU needed: NVML and torch are faked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.gpu_worker import telemetry

UUID_A = "11111111-2222-3333-4444-555555555555"
UUID_B = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


class FakeNVML:
    """Physical GPU 0 is UUID_A, GPU 1 is UUID_B; ``mig`` lists MIG instance uuids."""

    class NVMLError(Exception):
        pass

    def __init__(self, mig=(), by_uuid=True):
        self.gpus = [f"GPU-{UUID_A}", f"GPU-{UUID_B}"]
        self.mig = [f"MIG-{u}" for u in mig]
        if not by_uuid:
            self.nvmlDeviceGetHandleByUUID = self._missing

    def _missing(self, uuid):
        raise self.NVMLError("function not found")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid in self.gpus or uuid in self.mig:
            return ("uuid", uuid)
        raise self.NVMLError("not found")

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("index", index)


def _cuda_uuid(monkeypatch, uuid):
    props = SimpleNamespace(uuid=uuid) if uuid is not None else SimpleNamespace()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


def test_nvml_uuid_spellings():
    assert telemetry.nvml_uuids(UUID_A) == [f"GPU-{UUID_A}", f"MIG-{UUID_A}"]
    assert telemetry.nvml_uuids(f"GPU-{UUID_A}") == [f"GPU-{UUID_A}"]
    assert telemetry.nvml_uuids("") == []
    assert telemetry.nvml_uuids("00000000-0000-0000-0000-000000000000") == []


@pytest.mark.parametrize(
    ("visible", "index", "expected"),
    [
        (None, 0, 0),
        (None, 1, 1),
        ("3,1", 0, 3),
        ("3,1", 1, 1),
        (" 2 , 0", 1, 0),
        (f"GPU-{UUID_B}", 0, 0),  # not an index: torch's index, as a last resort
        ("MIG-GPU-aaaa/1/0", 0, 0),
        ("0", 5, 5),
    ],
)
def test_physical_index_from_index_lists(monkeypatch, visible, index, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert telemetry._physical_index(torch.device("cuda", index)) == expected


def test_handle_by_the_uuid_cuda_reports(monkeypatch):
    # CUDA_VISIBLE_DEVICES names GPUs by UUID: torch's cuda:0 is physical GPU 1. The old
    # index fallback would have asked NVML about GPU 0.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"GPU-{UUID_B[:8]}")
    _cuda_uuid(monkeypatch, UUID_B)
    assert telemetry._nvml_handle(FakeNVML(), torch.device("cuda", 0)) == ("uuid", f"GPU-{UUID_B}")


def test_handle_of_a_mig_instance(monkeypatch):
    mig = "99999999-8888-7777-6666-555555555555"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{mig}")
    _cuda_uuid(monkeypatch, mig)
    assert telemetry._nvml_handle(FakeNVML(mig=[mig]), torch.device("cuda", 0)) == (
        "uuid",
        f"MIG-{mig}",
    )


def test_handle_from_a_full_uuid_in_visible_devices(monkeypatch):
    # torch without props.uuid: a full UUID written in CUDA_VISIBLE_DEVICES still works.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"GPU-{UUID_A},GPU-{UUID_B}")
    _cuda_uuid(monkeypatch, None)
    assert telemetry._nvml_handle(FakeNVML(), torch.device("cuda", 1)) == ("uuid", f"GPU-{UUID_B}")


def test_falls_back_to_the_index_when_no_uuid_lookup_works(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    _cuda_uuid(monkeypatch, UUID_B)
    assert telemetry._nvml_handle(FakeNVML(by_uuid=False), torch.device("cuda", 0)) == ("index", 1)

    def broken(device):
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    assert telemetry._nvml_handle(FakeNVML(), torch.device("cuda", 1)) == ("index", 0)

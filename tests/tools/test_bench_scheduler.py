"""bench scheduler: a GPU the controller releases while it boots never sends GPU_READY."""

from __future__ import annotations

from services.scheduler.core.types import EventKind, Release, RequestGpus
from tools.bench import scheduler as bench


class _FakeView:
    def __init__(self):
        self.gpus = {"g0": None}
        self.billed_gpus = 1


class _Fake:
    """Asks for gx and gy on its first timed step; once gy is ready, cancels gx."""

    def __init__(self):
        self.view = _FakeView()
        self.ready: list[str] = []

    def note_pass(self, gpu_id, t):
        pass

    def step(self, event):
        if event.kind is EventKind.GPU_READY:
            self.ready.append(event.gpu_id)
            if event.gpu_id == "gy":
                return [Release("gx")]
            return []
        return []


def test_release_of_a_booting_gpu_removes_it_from_the_boot_queue(monkeypatch):
    import services.scheduler.core.policies as policies

    fake = _Fake()
    real_step = fake.step
    calls = {"n": 0}

    def step(event):
        calls["n"] += 1
        if calls["n"] == bench.SESSIONS_PER_GPU + 1:  # the first timed step
            return [RequestGpus(("gx", "gy"), "h20")]
        return real_step(event)

    fake.step = step
    monkeypatch.setattr(policies.Policies, "build", lambda *a, **k: fake)
    bench.bench_one(1, 10, 0)
    assert fake.ready == ["gy"]  # gx was cancelled: no (timed, no-op) GPU_READY for it


def test_track_booting():
    booting: list[str] = []
    bench.track_booting(booting, [RequestGpus(("a", "b"), "h20")])
    bench.track_booting(booting, [Release("a"), Release("zzz")])
    assert booting == ["b"]

"""A minimal environment for policy tests: replays decisions into its own state and checks
them against the rules, independently of the policy's view."""

from __future__ import annotations

from services.scheduler.core.types import (
    Assign,
    Decision,
    Drain,
    Event,
    EventKind,
    GpuState,
    Migrate,
    Release,
    RequestGpus,
    Resume,
    Suspend,
)


class Env:
    def __init__(self, policy) -> None:
        self.policy = policy
        self.capacity = policy.view.capacity
        self.gpus: dict[str, GpuState] = dict(policy.view.gpus)
        self.on_gpu: dict[str, set[str]] = {g: set() for g in self.gpus}
        self.where: dict[str, str] = {}  # active placed session -> GPU
        self.booting: list[str] = []  # requested, GPU_READY not yet sent (oldest first)
        self.released: list[str] = []
        self.scale_events = 0
        self.t = 0.0

    def send(self, event: Event) -> list[Decision]:
        self.t = event.t
        if event.kind is EventKind.DEPART:
            # A departure needs no decision: the environment frees the slot itself. (An idle
            # flip is freed by the policy's Suspend.)
            gpu = self.where.pop(event.session_id, None)
            if gpu is not None:
                self.on_gpu[gpu].discard(event.session_id)
        if event.kind is EventKind.GPU_READY:
            self.gpus[event.gpu_id] = GpuState.READY
        if event.kind is EventKind.GPU_GONE:
            for sid in self.on_gpu.pop(event.gpu_id, set()):
                self.where.pop(sid, None)
            self.gpus.pop(event.gpu_id, None)
            if event.gpu_id in self.booting:
                self.booting.remove(event.gpu_id)
        out = self.policy.step(event)
        for decision in out:
            self.apply(decision)
        return out

    def apply(self, d: Decision) -> None:
        if isinstance(d, Assign | Resume):
            assert d.session_id not in self.where, f"{d} but already on {self.where[d.session_id]}"
            assert self.gpus.get(d.gpu_id) is GpuState.READY, f"{d} onto {self.gpus.get(d.gpu_id)}"
            self._put(d.session_id, d.gpu_id)
        elif isinstance(d, Migrate):
            assert self.where.get(d.session_id) == d.src, f"{d} but session is on {self.where.get(d.session_id)}"
            assert self.gpus.get(d.dst) is GpuState.READY, f"{d} onto {self.gpus.get(d.dst)}"
            self.on_gpu[d.src].discard(d.session_id)
            del self.where[d.session_id]
            self._put(d.session_id, d.dst)
        elif isinstance(d, Suspend):
            assert self.where.get(d.session_id) == d.gpu_id, f"{d} but on {self.where.get(d.session_id)}"
            self.on_gpu[d.gpu_id].discard(d.session_id)
            del self.where[d.session_id]
        elif isinstance(d, RequestGpus):
            self.scale_events += 1
            for g in d.gpu_ids:
                assert g not in self.gpus and g not in self.released, f"{g} named twice"
                self.gpus[g] = GpuState.BOOTING
                self.on_gpu[g] = set()
                self.booting.append(g)
        elif isinstance(d, Drain):
            assert self.gpus.get(d.gpu_id) is GpuState.READY, f"{d} of a {self.gpus.get(d.gpu_id)} GPU"
            self.gpus[d.gpu_id] = GpuState.DRAINING
        elif isinstance(d, Release):
            assert d.gpu_id in self.gpus, f"{d} of an unknown GPU"
            assert not self.on_gpu[d.gpu_id], f"{d} while it holds {sorted(self.on_gpu[d.gpu_id])}"
            del self.gpus[d.gpu_id]
            del self.on_gpu[d.gpu_id]
            if d.gpu_id in self.booting:
                self.booting.remove(d.gpu_id)
            self.released.append(d.gpu_id)
        else:  # pragma: no cover - a new decision type must be handled here
            raise AssertionError(f"unknown decision {d!r}")

    def _put(self, session_id: str, gpu_id: str) -> None:
        self.where[session_id] = gpu_id
        self.on_gpu[gpu_id].add(session_id)
        assert len(self.on_gpu[gpu_id]) <= self.capacity, f"{gpu_id} above K = {self.capacity}"

    def boot_one(self) -> list[Decision]:
        if not self.booting:
            return []
        return self.send(Event(self.t, EventKind.GPU_READY, gpu_id=self.booting.pop(0)))

    def check(self) -> None:
        """Invariants that must hold after every step."""
        view = self.policy.view
        assert view.placement == self.where, "policy view and replayed decisions disagree"
        counts = view.active_counts
        assert all(n <= view.capacity for n in counts.values()), counts
        seen: set[str] = set()
        for g, sessions in self.on_gpu.items():
            assert not (sessions & seen), f"a session on two GPUs: {sessions & seen}"
            seen |= sessions
            assert counts.get(g, 0) == len(sessions)
        assert view.gpus == self.gpus
        if view.pending:  # every active session placed when capacity allows
            ready_with_room = [
                g for g, s in self.gpus.items()
                if s is GpuState.READY and len(self.on_gpu[g]) < view.capacity
            ]
            assert not ready_with_room, f"{view.pending} wait while {ready_with_room} have room"

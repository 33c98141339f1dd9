"""A minimal environment for policy tests: replays decisions into its own state and checks
them against the rules, independently of the policy's view.

With ``fail`` set (a callable deciding, per decision, whether it fails), it also plays a live
environment where commands go wrong: a failed ``Migrate`` leaves the session on its source, a
failed ``Assign``/``Resume`` leaves it on no GPU, and each is reported back to the policy
(``MIGRATION_FAILED`` / ``PLACEMENT_FAILED``) right after the step. A command onto a GPU that is
full in fact (because of a failure the policy has not heard of yet) is refused the same way,
as a real worker would. A ``Release`` of a GPU that still holds a session is allowed only when
the policy thinks the session left by a migration that failed: the environment then keeps the
GPU (draining) until the policy, told of the failure, releases it again."""

from __future__ import annotations

from collections.abc import Callable

from lab.sim.policies import POLICIES
from services.scheduler.core.loop import Profiles
from services.scheduler.core.policies import Policy
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


def build(name: str, profiles: Profiles, **params: object) -> Policy:
    """Policy ``name`` (of the simulator's: the live ones and the offline ones) from loose
    parameters, as a command line's ``--param`` gives them."""
    return POLICIES.build(name, profiles, POLICIES.config(name, params))


class Env:
    def __init__(self, policy, fail: Callable[[Decision], bool] | None = None) -> None:
        self.policy = policy
        view = policy.view
        self.gpus: dict[str, GpuState] = dict(view.gpus)
        self.kinds: dict[str, str] = {g: view.kind_of(g) for g in self.gpus}
        self.on_gpu: dict[str, set[str]] = {g: set() for g in self.gpus}
        self.where: dict[str, str] = {}  # active placed session -> GPU
        self.booting: list[str] = []  # requested, GPU_READY not yet sent (oldest first)
        self.released: list[str] = []
        self.cordoned: set[str] = set()  # drained by the operator, kept until uncordoned
        self.scale_events = 0
        self.t = 0.0
        self.fail = fail
        self.reports: list[Event] = []  # failures to tell the policy after this step
        self.unplaced: set[str] = set()  # sessions whose placement failed, not yet reported
        self.failures = 0

    def capacity(self, gpu_id: str) -> int:
        """K of the GPU's kind (from the policy's profiles: the GPU may have left its view)."""
        profiles = self.policy.view.profiles
        return profiles.get(self.kinds[gpu_id], self.policy.view.profile).capacity

    def send(self, event: Event) -> list[Decision]:
        self.t = event.t
        if event.kind is EventKind.DEPART:
            # A departure needs no decision: the environment frees the slot itself. (An idle
            # flip is freed by the policy's Suspend.)
            assert event.session_id is not None
            gpu = self.where.pop(event.session_id, None)
            if gpu is not None:
                self.on_gpu[gpu].discard(event.session_id)
        if event.kind is EventKind.GPU_READY:
            assert event.gpu_id is not None
            if event.gpu_id not in self.gpus:  # a GPU the policy did not ask for
                self.on_gpu[event.gpu_id] = set()
                self.kinds[event.gpu_id] = event.gpu_kind or self.policy.view.profile.gpu_kind
            self.gpus[event.gpu_id] = GpuState.READY
        if (
            event.kind is EventKind.GPU_CORDON
            and event.gpu_id is not None
            and event.gpu_id in self.policy.view.gpus
            and self.gpus.get(event.gpu_id) in (GpuState.READY, GpuState.DRAINING)
        ):
            # The operator drained the worker: it takes nothing new, and stays.
            self.gpus[event.gpu_id] = GpuState.DRAINING
            self.cordoned.add(event.gpu_id)
        if (
            event.kind is EventKind.GPU_UNCORDON
            and event.gpu_id is not None
            and event.gpu_id in self.cordoned
        ):
            self.cordoned.discard(event.gpu_id)
            self.gpus[event.gpu_id] = GpuState.READY
        if event.kind is EventKind.GPU_DRAIN:
            self.cordoned.discard(event.gpu_id)  # to be given back once empty
        if event.kind is EventKind.GPU_GONE:
            assert event.gpu_id is not None
            self.cordoned.discard(event.gpu_id)
            for sid in self.on_gpu.pop(event.gpu_id, set()):
                self.where.pop(sid, None)
            self.gpus.pop(event.gpu_id, None)
            if event.gpu_id in self.booting:
                self.booting.remove(event.gpu_id)
        out = self.policy.step(event)
        for decision in out:
            self.apply(decision)
        self._report()
        return out

    def _report(self) -> None:
        """Tell the policy what failed (each report is a step that may fail again; bounded)."""
        for _ in range(500):
            if not self.reports:
                return
            event = self.reports.pop(0)
            self.unplaced.discard(event.session_id)
            for decision in self.policy.step(event):
                self.apply(decision)
        raise AssertionError("failure reports do not settle")

    def _fails(self, d: Decision) -> bool:
        return self.fail is not None and self.fail(d)

    def apply(self, d: Decision) -> None:
        if isinstance(d, Assign | Resume):
            assert d.session_id not in self.where, f"{d} but already on {self.where[d.session_id]}"
            assert self.gpus.get(d.gpu_id) is GpuState.READY, f"{d} onto {self.gpus.get(d.gpu_id)}"
            if self._fails(d) or self._refused(d.gpu_id):
                self.failures += 1
                self.unplaced.add(d.session_id)
                self.reports.append(
                    Event(self.t, EventKind.PLACEMENT_FAILED, d.session_id, d.gpu_id)
                )
                return
            self._put(d.session_id, d.gpu_id)
        elif isinstance(d, Migrate):
            if d.session_id in self.unplaced:
                return  # its placement failed: nothing to move (the report says where it is)
            if self.where.get(d.session_id) != d.src and self._reported(d.session_id):
                # Decided before the policy heard of an earlier failure: the source does not
                # hold it, so this one fails too; the report says where it is.
                self.failures += 1
                self.reports.append(
                    Event(
                        self.t, EventKind.MIGRATION_FAILED, d.session_id, self.where[d.session_id]
                    )
                )
                return
            assert self.where.get(d.session_id) == d.src, (
                f"{d} but session is on {self.where.get(d.session_id)}"
            )
            assert self.gpus.get(d.dst) is GpuState.READY, f"{d} onto {self.gpus.get(d.dst)}"
            if self._fails(d) or self._refused(d.dst):
                self.failures += 1
                self.reports.append(Event(self.t, EventKind.MIGRATION_FAILED, d.session_id, d.src))
                return
            self.on_gpu[d.src].discard(d.session_id)
            del self.where[d.session_id]
            self._put(d.session_id, d.dst)
        elif isinstance(d, Suspend):
            if d.session_id in self.unplaced:
                return
            where = self.where.get(d.session_id)
            assert where == d.gpu_id or self._reported(d.session_id), f"{d} but on {where}"
            assert where is not None
            self.on_gpu[where].discard(d.session_id)  # wherever it is in fact
            del self.where[d.session_id]
        elif isinstance(d, RequestGpus):
            self.scale_events += 1
            for g in d.gpu_ids:
                assert g not in self.gpus and g not in self.released, f"{g} named twice"
                self.gpus[g] = GpuState.BOOTING
                self.kinds[g] = d.kind
                self.on_gpu[g] = set()
                self.booting.append(g)
        elif isinstance(d, Drain):
            assert self.gpus.get(d.gpu_id) is GpuState.READY, (
                f"{d} of a {self.gpus.get(d.gpu_id)} GPU"
            )
            self.gpus[d.gpu_id] = GpuState.DRAINING
        elif isinstance(d, Release):
            assert d.gpu_id in self.gpus, f"{d} of an unknown GPU"
            assert d.gpu_id not in self.cordoned, f"{d} of a GPU the operator keeps"
            held = self.on_gpu[d.gpu_id]
            moving_out = {
                e.session_id
                for e in self.reports
                if e.kind is EventKind.MIGRATION_FAILED and e.gpu_id == d.gpu_id
            }
            assert held <= moving_out, f"{d} while it holds {sorted(held)}"
            if held:
                return  # kept until its migrations are done; the policy will hear they failed
            del self.gpus[d.gpu_id]
            del self.on_gpu[d.gpu_id]
            if d.gpu_id in self.booting:
                self.booting.remove(d.gpu_id)
            self.released.append(d.gpu_id)
        else:  # pragma: no cover - a new decision type must be handled here
            raise AssertionError(f"unknown decision {d!r}")

    def _reported(self, session_id: str) -> bool:
        """A failure of this session is queued: the policy does not know where it is yet."""
        return any(e.session_id == session_id for e in self.reports)

    def _refused(self, gpu_id: str) -> bool:
        """Full in fact: only possible while a failure is unreported (else a policy bug)."""
        full = len(self.on_gpu[gpu_id]) >= self.capacity(gpu_id)
        assert not full or self.reports, f"{gpu_id} above K = {self.capacity(gpu_id)}"
        return full

    def _put(self, session_id: str, gpu_id: str) -> None:
        self.where[session_id] = gpu_id
        self.on_gpu[gpu_id].add(session_id)
        assert len(self.on_gpu[gpu_id]) <= self.capacity(gpu_id), f"{gpu_id} above K"

    def boot_one(self, kind: str | None = None) -> list[Decision]:
        if not self.booting:
            return []
        gpu_id = self.booting.pop(0)
        if kind is not None:
            self.kinds[gpu_id] = kind
        return self.send(Event(self.t, EventKind.GPU_READY, gpu_id=gpu_id, gpu_kind=kind))

    def check(self, active: set[str] | None = None, k_bound: bool = True) -> None:
        """Invariants that must hold after every step. ``active``: the sessions the driver
        made active (no session lost: each is placed or pending, never both). ``k_bound``:
        no GPU above K (False only right after a profile update lowered K)."""
        view = self.policy.view
        assert view.placement == self.where, "policy view and replayed decisions disagree"
        counts = view.active_counts
        for g, n in counts.items():
            assert not k_bound or n <= view.capacity_of(g), f"{g} holds {n} > K"
        seen: set[str] = set()
        for g, sessions in self.on_gpu.items():
            assert not (sessions & seen), f"a session on two GPUs: {sessions & seen}"
            seen |= sessions
            assert counts.get(g, 0) == len(sessions)
        assert view.gpus == self.gpus
        assert all(view.kind_of(g) == self.kinds[g] for g in self.gpus), "kinds disagree"
        assert set(view.cordoned) == self.cordoned, "cordoned GPUs disagree"
        for g, state in self.gpus.items():  # a drained GPU is released as soon as it is empty
            assert state is not GpuState.DRAINING or self.on_gpu[g] or g in self.cordoned, (
                f"{g} drained but kept"
            )
        if active is not None:
            pending = set(view.pending)
            assert not (pending & set(self.where)), "a session both placed and pending"
            assert pending | set(self.where) == active, "a session lost (or invented)"
        if view.pending and self.fail is None and k_bound:  # placed whenever room allows
            ready_with_room = [
                g
                for g, s in self.gpus.items()
                if s is GpuState.READY and len(self.on_gpu[g]) < view.capacity_of(g)
            ]
            assert not ready_with_room, f"{view.pending} wait while {ready_with_room} have room"

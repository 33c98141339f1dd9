"""The controller's incremental view of the pool: GPUs, sessions, placement and loads.

Loads are kept bucketed by active count (``buckets[n]`` = placeable GPUs holding ``n`` active
sessions, each bucket an insertion-ordered dict used as an ordered set), with pointers to the
lowest and highest non-empty bucket. Finding the least or most loaded GPU and moving a session
are O(1) amortised, which is what keeps one controller step in the microsecond range at a
thousand GPUs. Dict order (never set order, which depends on string hashing) keeps every choice
deterministic for a given event sequence.

Only READY GPUs are *placeable* and sit in the buckets. DRAINING GPUs may still hold sessions
(when migration is off) but take no new ones; BOOTING GPUs hold nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.core.profile import LatencyProfile
from services.scheduler.core.types import GpuState


@dataclass(slots=True)
class Gpu:
    gpu_id: str
    kind: str
    state: GpuState
    since: float  # time of the request (BOOTING) or of becoming READY
    sessions: dict[str, None] = field(default_factory=dict)  # active sessions, ordered
    step_end: float = float("-inf")  # when its pass in flight ends (Controller.note_step)


@dataclass(slots=True)
class Session:
    session_id: str
    active: bool
    state_bytes: int
    kappa_ms: float  # estimated migration cost (the copy) of this session
    gpu_id: str | None = None
    in_host_ram: bool = False  # suspended once: coming back is a Resume, not an Assign


class Cluster:
    """Mutable state with O(1) load queries; the policies own one each."""

    def __init__(self, profile: LatencyProfile) -> None:
        self.profile = profile
        self.capacity = profile.capacity
        self.gpus: dict[str, Gpu] = {}
        self.sessions: dict[str, Session] = {}
        self.pending: dict[str, None] = {}  # active sessions without a GPU, oldest first
        self.draining: dict[str, None] = {}
        self.booting: dict[str, None] = {}
        self._buckets: list[dict[str, None]] = [{} for _ in range(self.capacity + 1)]
        self._lo = 0
        self._hi = 0
        self.n_placeable = 0
        self.n_active = 0
        self.version = 0  # bumped whenever the set of placeable GPUs changes

    # ---- GPUs ---------------------------------------------------------------------------

    def add_gpu(self, gpu_id: str, kind: str, state: GpuState, t: float) -> None:
        if gpu_id in self.gpus:
            raise ValueError(f"GPU {gpu_id!r} already in the cluster")
        self.gpus[gpu_id] = Gpu(gpu_id, kind, state, t)
        self.version += 1
        if state is GpuState.READY:
            self._bucket_add(gpu_id, 0)
        elif state is GpuState.BOOTING:
            self.booting[gpu_id] = None
        else:
            self.draining[gpu_id] = None

    def mark_ready(self, gpu_id: str, t: float) -> None:
        gpu = self.gpus[gpu_id]
        if gpu.state is not GpuState.BOOTING:
            return
        del self.booting[gpu_id]
        self.version += 1
        gpu.state = GpuState.READY
        gpu.since = t
        self._bucket_add(gpu_id, len(gpu.sessions))

    def mark_draining(self, gpu_id: str) -> None:
        gpu = self.gpus[gpu_id]
        if gpu.state is GpuState.READY:
            self._bucket_remove(gpu_id, len(gpu.sessions))
        elif gpu.state is GpuState.BOOTING:
            del self.booting[gpu_id]
        else:
            return
        gpu.state = GpuState.DRAINING
        self.draining[gpu_id] = None
        self.version += 1

    def remove_gpu(self, gpu_id: str) -> list[str]:
        """Forget a GPU; its active sessions become pending (their state is lost)."""
        gpu = self.gpus.pop(gpu_id)
        self.version += 1
        if gpu.state is GpuState.READY:
            self._bucket_remove(gpu_id, len(gpu.sessions))
        elif gpu.state is GpuState.BOOTING:
            del self.booting[gpu_id]
        else:
            del self.draining[gpu_id]
        displaced = list(gpu.sessions)
        for sid in displaced:
            session = self.sessions[sid]
            session.gpu_id = None
            session.in_host_ram = False
            self.pending[sid] = None
        return displaced

    # ---- sessions -----------------------------------------------------------------------

    def add_session(self, session_id: str) -> Session:
        session = Session(
            session_id,
            active=True,
            state_bytes=self.profile.state_bytes_per_session,
            kappa_ms=self.profile.migration_ms(),
        )
        self.sessions[session_id] = session
        self.pending[session_id] = None
        self.n_active += 1
        return session

    def activate(self, session_id: str) -> None:
        session = self.sessions[session_id]
        if session.active:
            return
        session.active = True
        self.pending[session_id] = None
        self.n_active += 1

    def deactivate(self, session_id: str) -> str | None:
        """Active -> idle; returns the GPU it left (None if it was pending)."""
        session = self.sessions[session_id]
        if not session.active:
            return None
        session.active = False
        session.in_host_ram = True
        self.n_active -= 1
        self.pending.pop(session_id, None)
        return self.unplace(session_id)

    def remove_session(self, session_id: str) -> str | None:
        session = self.sessions[session_id]
        gpu_id = None
        if session.active:
            self.n_active -= 1
            self.pending.pop(session_id, None)
            gpu_id = self.unplace(session_id)
        del self.sessions[session_id]
        return gpu_id

    def place(self, session_id: str, gpu_id: str) -> None:
        """Put a pending session on a placeable GPU with room."""
        del self.pending[session_id]
        self.sessions[session_id].gpu_id = gpu_id
        self._attach(session_id, gpu_id)

    def unplace(self, session_id: str) -> str | None:
        session = self.sessions[session_id]
        gpu_id = session.gpu_id
        if gpu_id is None:
            return None
        session.gpu_id = None
        self._detach(session_id, gpu_id)
        return gpu_id

    def move(self, session_id: str, dst: str) -> str:
        session = self.sessions[session_id]
        src = session.gpu_id
        assert src is not None and src != dst
        self._detach(session_id, src)
        session.gpu_id = dst
        self._attach(session_id, dst)
        return src

    def _attach(self, session_id: str, gpu_id: str) -> None:
        gpu = self.gpus[gpu_id]
        n = len(gpu.sessions)
        if gpu.state is not GpuState.READY:
            raise ValueError(f"GPU {gpu_id!r} is {gpu.state}, not placeable")
        if n >= self.capacity:
            raise ValueError(f"GPU {gpu_id!r} is full ({n} of K = {self.capacity})")
        self._bucket_remove(gpu_id, n)
        gpu.sessions[session_id] = None
        self._bucket_add(gpu_id, n + 1)

    def _detach(self, session_id: str, gpu_id: str) -> None:
        gpu = self.gpus[gpu_id]
        n = len(gpu.sessions)
        if gpu.state is GpuState.READY:
            self._bucket_remove(gpu_id, n)
            del gpu.sessions[session_id]
            self._bucket_add(gpu_id, n - 1)
        else:
            del gpu.sessions[session_id]

    # ---- load queries -------------------------------------------------------------------

    def load(self, gpu_id: str) -> int:
        return len(self.gpus[gpu_id].sessions)

    @property
    def min_load(self) -> int:
        return self._lo

    @property
    def max_load(self) -> int:
        """Active sessions on the fullest placeable GPU (0 when none is placeable)."""
        return self._hi

    def least_loaded(self) -> str | None:
        """A placeable GPU with the fewest sessions and room for one more, or None."""
        if self.n_placeable == 0 or self._lo >= self.capacity:
            return None
        return next(iter(self._buckets[self._lo]))

    def most_loaded(self) -> str | None:
        if self.n_placeable == 0:
            return None
        return next(iter(self._buckets[self._hi]))

    def fullest_with_room(self) -> str | None:
        """A placeable GPU with the most sessions that still has room (best fit)."""
        if self.n_placeable == 0:
            return None
        for n in range(min(self._hi, self.capacity - 1), self._lo - 1, -1):
            if self._buckets[n]:
                return next(iter(self._buckets[n]))
        return None

    def bucket(self, load: int) -> dict[str, None]:
        """Placeable GPUs holding exactly ``load`` sessions (read-only by convention)."""
        return self._buckets[load]

    def worst_load(self) -> int:
        """Active sessions on the fullest GPU of any state (draining ones included)."""
        worst = self._hi if self.n_placeable else 0
        for gpu_id in self.draining:
            worst = max(worst, len(self.gpus[gpu_id].sessions))
        return worst

    def worst_latency_ms(self) -> float:
        return self.profile.chunk_ms(self.worst_load())

    @property
    def billed_gpus(self) -> int:
        return len(self.gpus)

    @property
    def budget(self) -> int:
        """GPUs that are or will be placeable: READY and BOOTING (DRAINING ones are leaving)."""
        return self.n_placeable + len(self.booting)

    # ---- buckets ------------------------------------------------------------------------

    def _bucket_add(self, gpu_id: str, n: int) -> None:
        self._buckets[n][gpu_id] = None
        if self.n_placeable == 0:
            self._lo = self._hi = n
        else:
            self._lo = min(self._lo, n)
            self._hi = max(self._hi, n)
        self.n_placeable += 1

    def _bucket_remove(self, gpu_id: str, n: int) -> None:
        del self._buckets[n][gpu_id]
        self.n_placeable -= 1
        if self.n_placeable == 0:
            self._lo = self._hi = 0
            return
        while not self._buckets[self._lo]:
            self._lo += 1
        while not self._buckets[self._hi]:
            self._hi -= 1


class ClusterView:
    """Read-only window on a policy's cluster for environments and tests.

    The mapping properties build fresh dicts (O(GPUs + sessions)): fine for checks and reports,
    not for every event of a hot loop; the scalar accessors are O(1)."""

    __slots__ = ("_cluster",)

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    @property
    def capacity(self) -> int:
        return self._cluster.capacity

    @property
    def profile(self) -> LatencyProfile:
        return self._cluster.profile

    @property
    def gpus(self) -> dict[str, GpuState]:
        return {g.gpu_id: g.state for g in self._cluster.gpus.values()}

    @property
    def placement(self) -> dict[str, str]:
        """Active session -> GPU for every placed session."""
        return {
            sid: gpu.gpu_id for gpu in self._cluster.gpus.values() for sid in gpu.sessions
        }

    @property
    def active_counts(self) -> dict[str, int]:
        return {g.gpu_id: len(g.sessions) for g in self._cluster.gpus.values()}

    @property
    def pending(self) -> tuple[str, ...]:
        """Active sessions waiting for a slot, oldest first."""
        return tuple(self._cluster.pending)

    @property
    def active_sessions(self) -> int:
        return self._cluster.n_active

    @property
    def idle_sessions(self) -> tuple[str, ...]:
        return tuple(s.session_id for s in self._cluster.sessions.values() if not s.active)

    @property
    def billed_gpus(self) -> int:
        """GPUs that cost money now: booting, ready and draining."""
        return self._cluster.billed_gpus

    def state_of(self, gpu_id: str) -> GpuState | None:
        gpu = self._cluster.gpus.get(gpu_id)
        return None if gpu is None else gpu.state

    def gpu_of(self, session_id: str) -> str | None:
        session = self._cluster.sessions.get(session_id)
        return None if session is None else session.gpu_id

    def load(self, gpu_id: str) -> int:
        return self._cluster.load(gpu_id)

    def since(self, gpu_id: str) -> float:
        """When the GPU was requested (BOOTING) or became READY."""
        return self._cluster.gpus[gpu_id].since

    def worst_latency_ms(self) -> float:
        """Chunk time of the fullest GPU, from the profile (migration costs not included)."""
        return self._cluster.worst_latency_ms()

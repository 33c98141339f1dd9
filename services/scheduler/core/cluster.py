"""The controller's incremental view of the pool: GPUs, sessions, placement and loads.

A pool may hold GPUs of several *kinds*, each with its own latency profile (capacity K,
chunk time per batch). The READY GPUs of one kind form a :class:`KindPool`, bucketed by active
count (``buckets[n]`` = GPUs of that kind holding ``n`` active sessions, each bucket an
insertion-ordered dict used as an ordered set), with pointers to the lowest and highest
non-empty bucket. Finding the least or most loaded GPU of a kind and moving a session are O(1)
amortised; queries across kinds are O(kinds), and a pool has one or a few. That is what keeps
one controller step in the microsecond range at a thousand GPUs. Dict order (never set order,
which depends on string hashing) keeps every choice deterministic for a given event sequence.

Only READY GPUs are *placeable* and sit in the buckets. DRAINING GPUs may still hold sessions
(when migration is off, or a migration off them failed) but take no new ones; BOOTING GPUs hold
nothing.

A GPU may hold more than its K in one case only: what the environment reports as fact
(a failed migration leaves the session on its source, a restart finds sessions where they
are, a profile update lowers K). Placement never adds to such a GPU, and the rebalance moves
sessions off it first, since it has the worst latency.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from services.scheduler.core.types import GpuState
from shared.profile import LatencyProfile

NEVER = float("-inf")


@dataclass(slots=True)
class Gpu:
    gpu_id: str
    kind: str
    state: GpuState
    since: float  # time of the request (BOOTING) or of becoming READY
    sessions: dict[str, None] = field(default_factory=dict)  # active sessions, ordered
    step_end: float = NEVER  # when its pass in flight ends (Controller.note_pass)


@dataclass(slots=True)
class Session:
    session_id: str
    active: bool
    state_bytes: int
    kappa_ms: float  # estimated migration cost (the copy) of this session
    gpu_id: str | None = None
    in_host_ram: bool = False  # suspended once: coming back is a Resume, not an Assign
    # After a failed migration or placement: no move of this session, and no placement on
    # ``failed_gpu``, before ``backoff_until``.
    backoff_until: float = NEVER
    failed_gpu: str | None = None


class KindPool:
    """The READY GPUs of one kind, bucketed by active count."""

    __slots__ = ("buckets", "capacity", "hi", "kind", "lo", "n", "profile", "table")

    def __init__(self, kind: str, profile: LatencyProfile) -> None:
        self.kind = kind
        self.profile = profile
        self.capacity = profile.capacity
        self.table = profile.chunk_ms_table
        self.buckets: list[dict[str, None]] = [{} for _ in range(self.capacity + 1)]
        self.lo = 0
        self.hi = 0
        self.n = 0

    def set_profile(self, profile: LatencyProfile) -> None:
        self.profile = profile
        self.capacity = profile.capacity
        self.table = profile.chunk_ms_table
        while len(self.buckets) <= self.capacity:
            self.buckets.append({})

    def add(self, gpu_id: str, n: int) -> None:
        while len(self.buckets) <= n:
            self.buckets.append({})
        self.buckets[n][gpu_id] = None
        if self.n == 0:
            self.lo = self.hi = n
        else:
            self.lo = min(self.lo, n)
            self.hi = max(self.hi, n)
        self.n += 1

    def remove(self, gpu_id: str, n: int) -> None:
        del self.buckets[n][gpu_id]
        self.n -= 1
        if self.n == 0:
            self.lo = self.hi = 0
            return
        while not self.buckets[self.lo]:
            self.lo += 1
        while not self.buckets[self.hi]:
            self.hi -= 1

    def least_loaded(self) -> str | None:
        """A GPU of this kind with the fewest sessions and room for one more, or None."""
        if self.n == 0 or self.lo >= self.capacity:
            return None
        return next(iter(self.buckets[self.lo]))

    def below(self, latency_ms: float) -> int:
        """The highest load whose chunk time is below ``latency_ms``, capped at K: a GPU of
        this kind may take sessions up to this load without reaching that latency."""
        return min(bisect.bisect_left(self.table, latency_ms), self.capacity)


class Cluster:
    """Mutable state with O(1) load queries per kind; the policies own one each.

    ``profiles`` maps each GPU kind to its latency profile (a single profile: one kind,
    its ``gpu_kind``). ``default_kind`` (default: the first) is the kind new GPUs are asked
    for, the unit of the autoscaler's GPU count, and the stand-in profile of a GPU whose
    kind has none (until ``set_profile`` gives it one)."""

    def __init__(
        self,
        profiles: LatencyProfile | Mapping[str, LatencyProfile],
        default_kind: str | None = None,
    ) -> None:
        if isinstance(profiles, LatencyProfile):
            profiles = {profiles.gpu_kind: profiles}
        if not profiles:
            raise ValueError("a cluster needs at least one latency profile")
        for kind, profile in profiles.items():
            if not isinstance(profile, LatencyProfile):
                raise TypeError(
                    f"profile of kind {kind!r} must be a LatencyProfile, got "
                    f"{type(profile).__name__}"
                )
        self.default_kind = default_kind if default_kind is not None else next(iter(profiles))
        if self.default_kind not in profiles:
            # A default kind without a profile of its own is served by the first profile.
            profiles = {**profiles, self.default_kind: next(iter(profiles.values()))}
        self.profiles: dict[str, LatencyProfile] = dict(profiles)
        self.pools: dict[str, KindPool] = {k: KindPool(k, p) for k, p in self.profiles.items()}
        self._stand_ins: set[str] = set()  # kinds served by the default kind's profile
        self.gpus: dict[str, Gpu] = {}
        self.sessions: dict[str, Session] = {}
        self.pending: dict[str, None] = {}  # active sessions without a GPU, oldest first
        self.draining: dict[str, None] = {}
        self.cordoned: dict[str, None] = {}  # draining GPUs an operator keeps (not released)
        self.booting: dict[str, None] = {}
        self.n_placeable = 0
        self.n_active = 0
        self.version = 0  # bumped whenever the set of placeable GPUs changes

    # ---- kinds and profiles -------------------------------------------------------------

    @property
    def profile(self) -> LatencyProfile:
        """The default kind's profile."""
        return self.profiles[self.default_kind]

    @property
    def capacity(self) -> int:
        """K of the default kind: the unit of the autoscaler's GPU count."""
        return self.pools[self.default_kind].capacity

    def pool(self, kind: str) -> KindPool:
        """The pool of ``kind``; a kind without a profile gets the default kind's."""
        pool = self.pools.get(kind)
        if pool is None:
            pool = self.pools[kind] = KindPool(kind, self.profile)
            self.profiles[kind] = self.profile
            self._stand_ins.add(kind)
        return pool

    def set_profile(self, kind: str, profile: LatencyProfile) -> None:
        """Give ``kind`` a new latency profile (K may change; loads stay where they are)."""
        self._stand_ins.discard(kind)
        self.profiles[kind] = profile
        self.pool(kind).set_profile(profile)
        if kind == self.default_kind:
            for other in self._stand_ins:
                self.profiles[other] = profile
                self.pools[other].set_profile(profile)
        self.version += 1

    def profile_of(self, gpu_id: str) -> LatencyProfile:
        return self.pools[self.gpus[gpu_id].kind].profile

    def capacity_of(self, gpu_id: str) -> int:
        return self.pools[self.gpus[gpu_id].kind].capacity

    def live_pools(self) -> Iterator[KindPool]:
        """Pools with at least one placeable GPU, in kind order."""
        return (p for p in self.pools.values() if p.n)

    # ---- GPUs ---------------------------------------------------------------------------

    def add_gpu(self, gpu_id: str, kind: str, state: GpuState, t: float) -> None:
        if gpu_id in self.gpus:
            raise ValueError(f"GPU {gpu_id!r} already in the cluster")
        pool = self.pool(kind)
        self.gpus[gpu_id] = Gpu(gpu_id, kind, state, t)
        self.version += 1
        if state is GpuState.READY:
            pool.add(gpu_id, 0)
            self.n_placeable += 1
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
        self.pools[gpu.kind].add(gpu_id, len(gpu.sessions))
        self.n_placeable += 1

    def mark_draining(self, gpu_id: str) -> None:
        gpu = self.gpus[gpu_id]
        if gpu.state is GpuState.READY:
            self.pools[gpu.kind].remove(gpu_id, len(gpu.sessions))
            self.n_placeable -= 1
        elif gpu.state is GpuState.BOOTING:
            del self.booting[gpu_id]
        else:
            return
        gpu.state = GpuState.DRAINING
        self.draining[gpu_id] = None
        self.version += 1

    def mark_undrained(self, gpu_id: str) -> None:
        """A DRAINING GPU takes sessions again (an operator's drain undone)."""
        gpu = self.gpus[gpu_id]
        if gpu.state is not GpuState.DRAINING:
            return
        del self.draining[gpu_id]
        self.cordoned.pop(gpu_id, None)
        gpu.state = GpuState.READY
        self.pools[gpu.kind].add(gpu_id, len(gpu.sessions))
        self.n_placeable += 1
        self.version += 1

    def remove_gpu(self, gpu_id: str) -> list[str]:
        """Forget a GPU; its active sessions become pending (their state is lost)."""
        gpu = self.gpus.pop(gpu_id)
        self.cordoned.pop(gpu_id, None)
        self.version += 1
        if gpu.state is GpuState.READY:
            self.pools[gpu.kind].remove(gpu_id, len(gpu.sessions))
            self.n_placeable -= 1
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

    def add_session(self, session_id: str, active: bool = True) -> Session:
        profile = self.profile
        session = Session(
            session_id,
            active=active,
            state_bytes=profile.state_bytes_per_session,
            kappa_ms=profile.migration_ms(),
        )
        self.sessions[session_id] = session
        if active:
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

    def put(self, session_id: str, gpu_id: str) -> None:
        """Record a fact: the active session ``session_id`` is on ``gpu_id`` (READY or
        DRAINING), wherever the view had it, even above K."""
        session = self.sessions[session_id]
        if session.gpu_id == gpu_id:
            return
        self.unplace(session_id)
        self.pending.pop(session_id, None)
        session.gpu_id = gpu_id
        self._attach(session_id, gpu_id, fact=True)

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

    def _attach(self, session_id: str, gpu_id: str, fact: bool = False) -> None:
        gpu = self.gpus[gpu_id]
        n = len(gpu.sessions)
        if gpu.state is GpuState.READY:
            pool = self.pools[gpu.kind]
            if n >= pool.capacity and not fact:
                raise ValueError(f"GPU {gpu_id!r} is full ({n} of K = {pool.capacity})")
            pool.remove(gpu_id, n)
            gpu.sessions[session_id] = None
            pool.add(gpu_id, n + 1)
        elif gpu.state is GpuState.DRAINING and fact:
            gpu.sessions[session_id] = None
        else:
            raise ValueError(f"GPU {gpu_id!r} is {gpu.state}, not placeable")

    def _detach(self, session_id: str, gpu_id: str) -> None:
        gpu = self.gpus[gpu_id]
        n = len(gpu.sessions)
        if gpu.state is GpuState.READY:
            pool = self.pools[gpu.kind]
            pool.remove(gpu_id, n)
            del gpu.sessions[session_id]
            pool.add(gpu_id, n - 1)
        else:
            del gpu.sessions[session_id]

    # ---- load queries -------------------------------------------------------------------

    def load(self, gpu_id: str) -> int:
        return len(self.gpus[gpu_id].sessions)

    @property
    def max_load(self) -> int:
        """Active sessions on the fullest placeable GPU, any kind (0 when none)."""
        return max((p.hi for p in self.live_pools()), default=0)

    def least_loaded(self) -> str | None:
        """A placeable GPU with the fewest sessions and room for one more, or None."""
        best: str | None = None
        best_load = 0
        for pool in self.live_pools():
            gpu_id = pool.least_loaded()
            if gpu_id is not None and (best is None or pool.lo < best_load):
                best, best_load = gpu_id, pool.lo
        return best

    def least_growth(self) -> str | None:
        """The placeable GPU with room whose chunk time grows least by taking one more session
        (ties: the first kind): with one kind, the least loaded GPU."""
        if len(self.pools) == 1:
            return self.pools[self.default_kind].least_loaded()
        best: str | None = None
        best_ms = 0.0
        for pool in self.live_pools():
            gpu_id = pool.least_loaded()
            if gpu_id is None:
                continue
            ms = pool.profile.chunk_ms(pool.lo + 1)
            if best is None or ms < best_ms:
                best, best_ms = gpu_id, ms
        return best

    def fullest_with_room(self) -> str | None:
        """A placeable GPU with the least room left (fewest sessions to K) that still has some (best
        fit)."""
        best: str | None = None
        best_free = 0
        for pool in self.live_pools():
            for n in range(min(pool.hi, pool.capacity - 1), pool.lo - 1, -1):
                if pool.buckets[n]:
                    free = pool.capacity - n
                    if best is None or free < best_free:
                        best, best_free = next(iter(pool.buckets[n])), free
                    break
        return best

    def bucket(self, load: int, kind: str | None = None) -> dict[str, None]:
        """Placeable GPUs of ``kind`` (default: the default kind) holding exactly ``load``
        sessions (read-only by convention)."""
        pool = self.pools[self.default_kind if kind is None else kind]
        return pool.buckets[load] if load < len(pool.buckets) else {}

    def rho_max(self) -> float:
        """Load of the fullest placeable GPU over its own K (0 when none is placeable)."""
        if len(self.pools) == 1:
            pool = self.pools[self.default_kind]
            return pool.hi / pool.capacity
        return max((p.hi / p.capacity for p in self.live_pools()), default=0.0)

    def worst_latency_ms(self) -> float:
        """Chunk time of the slowest GPU (draining ones included), each on its own profile."""
        worst = max((p.profile.chunk_ms(p.hi) for p in self.live_pools()), default=0.0)
        for gpu_id in self.draining:
            worst = max(worst, self.profile_of(gpu_id).chunk_ms(self.load(gpu_id)))
        return worst

    @property
    def billed_gpus(self) -> int:
        return len(self.gpus)

    @property
    def budget(self) -> int:
        """GPUs that are or will be placeable: READY and BOOTING (DRAINING ones are leaving)."""
        return self.n_placeable + len(self.booting)

    def budget_units(self) -> float:
        """:attr:`budget` counted in GPUs of the default kind (by capacity): with one kind, the
        budget itself; a GPU twice the default kind's K counts 2."""
        if len(self.pools) == 1:
            return self.budget
        slots = sum(p.capacity * p.n for p in self.pools.values())
        slots += sum(self.capacity_of(g) for g in self.booting)
        units = slots / self.capacity
        return int(units) if units == int(units) else units

    def units_of(self, gpu_id: str) -> float:
        """One GPU counted in GPUs of the default kind (1 with one kind)."""
        if len(self.pools) == 1:
            return 1
        return self.capacity_of(gpu_id) / self.capacity


class ClusterView:
    """Read-only window on a policy's cluster for environments and tests.

    The mapping properties build fresh dicts (O(GPUs + sessions)): fine for checks and reports,
    not for every event of a hot loop; the scalar accessors are O(1)."""

    __slots__ = ("_cluster",)

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    @property
    def capacity(self) -> int:
        """K of the default kind (see :meth:`capacity_of` for one GPU)."""
        return self._cluster.capacity

    @property
    def profile(self) -> LatencyProfile:
        """The default kind's profile (see :attr:`profiles`)."""
        return self._cluster.profile

    @property
    def profiles(self) -> dict[str, LatencyProfile]:
        """Latency profile per GPU kind."""
        return dict(self._cluster.profiles)

    @property
    def gpus(self) -> dict[str, GpuState]:
        return {g.gpu_id: g.state for g in self._cluster.gpus.values()}

    @property
    def cordoned(self) -> tuple[str, ...]:
        """Draining GPUs an operator keeps: never released by the loop, never counted."""
        return tuple(self._cluster.cordoned)

    @property
    def placement(self) -> dict[str, str]:
        """Active session -> GPU for every placed session."""
        return {sid: gpu.gpu_id for gpu in self._cluster.gpus.values() for sid in gpu.sessions}

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

    def is_idle(self, session_id: str) -> bool:
        """The session is known and idle (O(1))."""
        session = self._cluster.sessions.get(session_id)
        return session is not None and not session.active

    @property
    def billed_gpus(self) -> int:
        """GPUs that cost money now: booting, ready and draining."""
        return self._cluster.billed_gpus

    def state_of(self, gpu_id: str) -> GpuState | None:
        gpu = self._cluster.gpus.get(gpu_id)
        return None if gpu is None else gpu.state

    def kind_of(self, gpu_id: str) -> str | None:
        gpu = self._cluster.gpus.get(gpu_id)
        return None if gpu is None else gpu.kind

    def capacity_of(self, gpu_id: str) -> int:
        """K of the GPU's kind."""
        return self._cluster.capacity_of(gpu_id)

    def gpu_of(self, session_id: str) -> str | None:
        session = self._cluster.sessions.get(session_id)
        return None if session is None else session.gpu_id

    def load(self, gpu_id: str) -> int:
        return self._cluster.load(gpu_id)

    def since(self, gpu_id: str) -> float:
        """When the GPU was requested (BOOTING) or became READY."""
        return self._cluster.gpus[gpu_id].since

    def worst_latency_ms(self) -> float:
        """Chunk time of the slowest GPU, from its profile (migration costs not included)."""
        return self._cluster.worst_latency_ms()

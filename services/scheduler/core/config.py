"""``ControllerConfig``: everything a :class:`~services.scheduler.core.loop.Controller` is set
to, as one frozen value.

The core reads no files: a caller that wants the adaptive rho_hat table loads it
(``services.scheduler.shipped.load_rho_table``) and passes the :class:`RhoTable` here; the
latency profiles go to the controller itself, because they may be replaced between steps
(``Controller.set_profile``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from services.scheduler.core.autoscale import RhoTable

DEFAULT_BOOT_DELAY_S = 30.0
DEFAULT_ETA = 0.1
DEFAULT_RETRY_BACKOFF_S = 5.0
DEFAULT_PEAK_WINDOW_S = 300.0
DEFAULT_PEAK_SURGE_S = 60.0
PLACEMENTS = ("soonest_first_chunk", "least_loaded", "round_robin", "memory_aware")


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Settings of one controller. Defaults are TurboServe's; the built-in policies
    (``policies.LIVE_POLICIES``) are this class with switches."""

    name: str = "turboserve"
    # Placement rule for new, re-activated and displaced sessions (``placement.CHOOSERS``).
    placement: str = "soonest_first_chunk"
    migrate: bool = True  # rebalance by migration, and evacuate drained GPUs
    autoscale: bool = True
    # Target utilisation and its band; None: the rho_table's value at the current volatility
    # level (FALLBACK_RHO_HAT / FALLBACK_DELTA without a table).
    rho_hat: float | None = None
    delta: float | None = None
    rho_table: RhoTable | None = None
    # Share of idle sessions sized for as if active; None: the table's value (0 without).
    idle_reserve: float | None = None
    eta: float = DEFAULT_ETA  # weight of migration cost in the placement objective
    boot_delay_s: float = DEFAULT_BOOT_DELAY_S  # what the environment's GPUs take to boot
    initial_gpus: int = 1  # READY GPUs at construction (not used by Controller.restore)
    # Kind of the GPUs it starts with and asks for; None: the first profile's kind.
    gpu_kind: str | None = None
    # Names of the GPUs it asks for are "<prefix>-NNNN"; None: the kind in lower case. A live
    # scheduler that restarts gives each run its own (e.g. with its leader epoch), so that a
    # name is never given to two GPUs.
    gpu_id_prefix: str | None = None
    min_gpus: int = 1
    max_gpus: int | None = None
    # The environment keeps ``min_gpus`` GPUs running by itself (the live provisioner starts
    # workers up to its floor on its own): a scale-out counts the floor as there, so it never
    # asks for GPUs that the floor's own boots bring anyway.
    floor_kept: bool = False
    # Scale cool-down: for this long after a scale event no event the other way fires (no
    # scale-in after a scale-out, no scale-out after a scale-in unless sessions wait for a
    # slot), so a pool that just grew is not drained on the next swing, nor one just drained
    # grown again. 0: off.
    scale_cooldown_s: float = 0.0
    # Scale-in stabilisation window: the pool never shrinks below the highest target of the
    # last this many seconds (HPA's down-scale stabilisation); None: the table's value at the
    # current level (0 without a table).
    scale_in_delay_s: float | None = None
    # Peak cap: the pool never holds more GPUs than the highest active count of the last
    # ``peak_window_s`` needs at utilisation ``peak_rho`` (0: no cap); None: the table's value
    # at the current level (no cap without a table).
    peak_rho: float | None = None
    peak_window_s: float = DEFAULT_PEAK_WINDOW_S
    # The cap lifts while the active count is above every count of the peak window that is
    # older than this: load beyond what the recent past has seen is a surge, and the pool
    # grows for it with its full headroom.
    peak_surge_s: float = DEFAULT_PEAK_SURGE_S
    warmup_s: float | None = None  # no scale-in this long after the first event (None: boot)
    # After a failed migration or placement, the session is not moved again, nor placed on
    # the GPU that failed, for this long.
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S
    t0: float = 0.0  # time stamp of the initial GPUs
    # The quality budget's floor of denoising steps per chunk (``core/quality.py``); None, or
    # the model's full count: off.
    min_steps: int | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {self.placement!r}; known: {', '.join(PLACEMENTS)}"
            )
        if self.initial_gpus < 0 or self.min_gpus < 0:
            raise ValueError(
                f"initial_gpus and min_gpus must be >= 0, got {self.initial_gpus}, {self.min_gpus}"
            )
        if self.max_gpus is not None and self.max_gpus < max(1, self.min_gpus):
            raise ValueError(
                f"max_gpus must be >= max(1, min_gpus), got {self.max_gpus} "
                f"(min_gpus {self.min_gpus})"
            )
        if self.rho_hat is not None and not 0 < self.rho_hat <= 1:
            raise ValueError(f"rho_hat must be in (0, 1], got {self.rho_hat}")
        if self.delta is not None and not (math.isfinite(self.delta) and self.delta >= 0):
            raise ValueError(f"delta must be >= 0 and finite, got {self.delta}")
        if self.peak_rho is not None and not 0 <= self.peak_rho <= 1:
            raise ValueError(f"peak_rho must be in [0, 1] (0: no cap), got {self.peak_rho}")
        if not (math.isfinite(self.peak_window_s) and self.peak_window_s > 0):
            raise ValueError(f"peak_window_s must be > 0 and finite, got {self.peak_window_s}")
        if not (math.isfinite(self.peak_surge_s) and 0 <= self.peak_surge_s < self.peak_window_s):
            raise ValueError(
                f"peak_surge_s must be >= 0 and below peak_window_s "
                f"({self.peak_window_s}), got {self.peak_surge_s}"
            )
        for key in (
            "eta",
            "boot_delay_s",
            "scale_in_delay_s",
            "retry_backoff_s",
            "scale_cooldown_s",
        ):
            value = getattr(self, key)
            if value is None and key == "scale_in_delay_s":
                continue
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be >= 0 and finite, got {value}")
        if self.warmup_s is not None and not (math.isfinite(self.warmup_s) and self.warmup_s >= 0):
            raise ValueError(f"warmup_s must be >= 0 and finite, got {self.warmup_s}")
        if self.idle_reserve is not None and not 0 <= self.idle_reserve <= 1:
            raise ValueError(f"idle_reserve must be in [0, 1], got {self.idle_reserve}")
        if self.rho_table is not None and not isinstance(self.rho_table, RhoTable):
            raise TypeError(
                f"rho_table must be a RhoTable (load files with "
                f"services.scheduler.shipped.load_rho_table), got "
                f"{type(self.rho_table).__name__}"
            )
        if self.gpu_kind is not None and not (isinstance(self.gpu_kind, str) and self.gpu_kind):
            raise ValueError(f"gpu_kind must be a non-empty string, got {self.gpu_kind!r}")
        if self.gpu_id_prefix is not None and not (
            isinstance(self.gpu_id_prefix, str)
            and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", self.gpu_id_prefix)
        ):
            raise ValueError(
                f"gpu_id_prefix must be letters, digits, '-' or '_' (a NATS "
                f"subject token), got {self.gpu_id_prefix!r}"
            )

    @property
    def warmup(self) -> float:
        """The warm-up in force: ``warmup_s``, or one boot delay when it is None."""
        return self.boot_delay_s if self.warmup_s is None else self.warmup_s

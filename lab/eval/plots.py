"""PNG plots for the evaluation (matplotlib, Agg backend: no display needed).

Every function takes plain data and a path, and imports matplotlib only when called, so
importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from lab.eval.matched import CurvePoint, pareto_envelope

__all__ = ["plot_cost_latency", "plot_gpus_over_time", "plot_latency_cdf"]


def _use_agg() -> None:
    """Select the Agg backend; call before importing ``matplotlib.pyplot``."""
    import matplotlib

    matplotlib.use("Agg")


def plot_cost_latency(
    curves: Mapping[str, Sequence[CurvePoint]],
    path: Path,
    *,
    title: str,
    highlight: Mapping[str, CurvePoint] | None = None,
    floor_cost: float | None = None,
) -> Path:
    """One line per policy (its Pareto envelope, all points dotted); stars for highlights."""
    _use_agg()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        finite = [p for p in points if p.cost > 0 and p.latency > 0]
        if not finite:
            continue
        env = pareto_envelope(finite)
        (line,) = ax.plot([p.cost for p in env], [p.latency for p in env], "-o", ms=3, label=name)
        ax.scatter(
            [p.cost for p in finite],
            [p.latency for p in finite],
            s=8,
            color=line.get_color(),
            alpha=0.4,
        )
    for name, point in (highlight or {}).items():
        ax.scatter(
            [point.cost],
            [point.latency],
            marker="*",
            s=160,
            zorder=5,
            label=name,
            edgecolors="black",
        )
    if floor_cost is not None:
        ax.axvline(floor_cost, color="grey", ls="--", lw=1, label="floor (lower bound)")
    ax.set_xlabel("cost (GPU-hours)")
    ax.set_ylabel("p99 per-chunk latency (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_gpus_over_time(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    demand: tuple[Sequence[float], Sequence[float]],
    path: Path,
    *,
    title: str,
) -> Path:
    """GPUs held (step lines) per policy against the GPUs the demand needs at capacity K."""
    _use_agg()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(
        demand[0], demand[1], where="post", color="black", lw=1.2, label="demand: ceil(active / K)"
    )
    for name, (ts, gpus) in series.items():
        ax.step(ts, gpus, where="post", lw=1, alpha=0.85, label=name)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GPUs")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdf(
    latencies: Mapping[str, Sequence[float]],
    path: Path,
    *,
    title: str,
    deadline_ms: float | None = None,
) -> Path:
    """Latency distribution per policy as a tail plot: the share of chunks slower than x
    (1 - CDF, log scale), so p99 is where a curve crosses 0.01."""
    import numpy as np

    _use_agg()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in latencies.items():
        xs = np.sort(np.asarray(values, dtype=float))
        if xs.size == 0:
            continue
        tail = 1.0 - np.arange(1, xs.size + 1) / xs.size
        keep = tail > 0
        ax.step(xs[keep], tail[keep], where="post", lw=1.2, label=name)
    if deadline_ms is not None:
        ax.axvline(deadline_ms, color="grey", ls="--", lw=1, label="deadline")
    ax.axhline(0.01, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-chunk latency (ms)")
    ax.set_ylabel("share of chunks slower (1 - CDF)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

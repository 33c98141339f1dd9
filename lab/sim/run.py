"""``turboserve sim run``'s work as functions: :func:`sim_run` runs the policies a
:class:`RunRequest` names on its trace, :func:`sweep_at_slo` sweeps each one's cost to serve
99% of chunk periods on time, and the :class:`RunReport` they fill holds the values and the
lines ``sim run`` prints (``sim tables`` calls these, never the command).

Top-level imports stay light: numpy, the core, the simulator and the evaluation load inside
the functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# The paper's static baselines: they take a fixed ``gpus`` count and never scale.
STATIC_POLICIES = ("round_robin", "least_loaded", "memory_aware")
DEFAULT_BOOT_DELAY_S = 30.0


class UsageError(ValueError):
    """A command-line value out of range: printed as one line, exit status 2."""


def _parse_params(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param needs KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


@dataclass(frozen=True, slots=True)
class RunRequest:
    """What ``sim run`` is asked, its flags as values (``--param`` as KEY=VALUE strings)."""

    trace: str
    policy: str = "turboserve"
    gpus: int | None = None
    cold_start: bool = False
    rho_hat: float | None = None
    delta: float | None = None
    boot_delay: float = DEFAULT_BOOT_DELAY_S
    profile: str | None = None
    tick: float = 1.0
    resume_ms: float = 0.0
    param: tuple[str, ...] = ()
    timeline: bool = False
    at_slo: bool | None = None
    jobs: int = 1

    @property
    def sweeps(self) -> bool:
        """Whether ``sim run`` also sweeps each policy's cost to serve 99% of periods (by
        default with ``--policy all`` only)."""
        return self.at_slo if self.at_slo is not None else self.policy == "all"

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunRequest:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        return cls(**{**values, "param": tuple(values["param"])})


@dataclass(slots=True)
class RunReport:
    """What ``sim run`` measured: one row per policy run (``SimResult.to_json()``, with
    ``cost_at_slo`` once :func:`sweep_at_slo` ran), and what it prints: :meth:`lines`, then
    :meth:`sweep_lines`."""

    request: RunRequest
    trace: str
    heading: str  # the trace and the profile
    profile: str  # the profile's name
    rows: list[dict[str, Any]]
    note: str  # how the static pools were sized (--policy all), or ""
    wall_s: float  # the runs' wall time
    price: float | None  # the profile's price of a GPU-hour (None: it has none)
    # The sweep (:func:`sweep_at_slo`): each policy's cost to serve 99% of periods (None: not
    # swept yet) and its wall time.
    at_slo: dict[str, dict[str, Any] | None] | None = None
    sweep_wall_s: float = 0.0
    warnings: list[str] = field(default_factory=list)  # for stderr: what was left out

    def lines(self, wall: bool = True) -> list[str]:
        """The runs' report as ``sim run`` prints it; ``wall``: with the wall-time line."""
        from lab.sim.report import quality_lines, results_table

        out = [self.heading, results_table(self.rows, extra=["gpus"] if self.note else ())]
        if self.note:
            out.append(self.note)
        out += quality_lines(self.rows)
        out.append(
            "late ms: past each chunk's due time (0: on time); deadline % and stall-adj. %: "
            "the periods served on time in these runs."
            + (
                ""
                if self.request.sweeps
                else " The cost to serve 99% of periods (the headline figure) needs a sweep of "
                "each policy's setting: --at-slo, or turboserve sim evaluate [--traces DIR]"
            )
        )
        if wall:
            out.append(f"simulated {len(self.rows)} run(s) in {self.wall_s:.2f} s wall")
        return out

    def sweep_lines(self, wall: bool = True) -> list[str]:
        """The sweep's report as ``sim run`` prints it (nothing before :func:`sweep_at_slo`);
        ``wall``: with the wall-time line."""
        from lab.eval.service_level import SLO_ATTAINMENT, cost_cell
        from lab.eval.tables import markdown_table

        if self.at_slo is None:
            return []
        request, price = self.request, self.price
        table = []
        for row in self.rows:
            entry = self.at_slo[row["policy"]]
            if entry is None:
                table.append([row["policy"], "not swept by the evaluation", None, None, None])
                continue
            table.append(
                [
                    row["policy"],
                    cost_cell(entry),
                    entry["cost_gpu_hours"] * price
                    if price is not None and entry["reached"]
                    else None,
                    (
                        f"none of its sweep (up to {entry['gpus']} GPUs)"
                        if not entry["reached"] and "gpus" in entry
                        else "none of its sweep"
                        if not entry["reached"]
                        else f"{entry['gpus']} GPUs"
                        if "gpus" in entry
                        else "its curve, at most (its cheapest point serves more)"
                        if entry.get("upper_bound")
                        else "its curve"
                    ),
                    entry["runs"],
                ]
            )
        level = f"{100 * SLO_ATTAINMENT:g}%"
        out = [
            "",
            f"cost to serve {level} of chunk periods on time (stall-adjusted), each policy's "
            f"setting swept on {request.trace} as sim evaluate sweeps it:",
            markdown_table(
                ["policy", f"GPU-h @ {level}", f"$ @ {level}", "read at", "runs"], table, digits=2
            ),
            *_comparisons_at_slo(self.at_slo),
        ]
        ignored = [
            flag
            for flag, given in (
                ("--rho-hat", request.rho_hat is not None),
                ("--delta", request.delta is not None),
                ("--param", bool(request.param)),
                ("--gpus", request.gpus is not None),
                ("--cold-start", request.cold_start),
                ("--tick", request.tick != 1.0),
                ("--resume-ms", request.resume_ms != 0.0),
            )
            if given
        ]
        if ignored:
            out.append(
                f"note: {', '.join(ignored)} apply to the runs above, not to the sweep (it uses "
                f"the evaluation's settings)"
            )
        if wall:
            runs = sum(e["runs"] for e in self.at_slo.values() if e)
            out.append(f"simulated {runs} run(s) for the sweep in {self.sweep_wall_s:.1f} s wall")
        return out


def _check_run_args(request: RunRequest) -> None:
    """Ranges the simulator itself needs; the policy checks its own knobs (rho_hat, delta,
    --param) when it is built and says what it does not take."""
    if request.gpus is not None and request.gpus < 0:
        raise UsageError(f"--gpus must be >= 0, got {request.gpus}")
    if not (math.isfinite(request.boot_delay) and request.boot_delay >= 0):
        raise UsageError(
            f"--boot-delay must be a finite number of seconds >= 0, got {request.boot_delay:g}"
        )
    if not (math.isfinite(request.tick) and request.tick > 0):
        raise UsageError(f"--tick must be > 0 seconds, got {request.tick:g}")
    if not (math.isfinite(request.resume_ms) and request.resume_ms >= 0):
        raise UsageError(f"--resume-ms must be >= 0, got {request.resume_ms:g}")
    if request.rho_hat is not None and not (0.0 < request.rho_hat <= 1.0):
        raise UsageError(f"--rho-hat must be in (0, 1], got {request.rho_hat:g}")
    if request.delta is not None and not (math.isfinite(request.delta) and request.delta >= 0):
        raise UsageError(f"--delta must be >= 0, got {request.delta:g}")
    if request.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {request.jobs}")
    if not any(name.strip() for name in request.policy.split(",")):
        raise UsageError(f"--policy needs a policy name, got {request.policy!r}")


def sim_run(request: RunRequest) -> RunReport:
    """Run the policies ``request`` names on its trace (``sim run``'s runs, without printing;
    the sweep is :func:`sweep_at_slo`)."""
    from lab.sim.catalog import load_trace
    from lab.sim.report import progress_bar
    from lab.sim.simulator import simulate
    from shared.profile import load_profile

    _check_run_args(request)
    trace = load_trace(request.trace)
    profile = load_profile() if request.profile is None else load_profile(request.profile)
    params = _parse_params(list(request.param))
    if request.rho_hat is not None:
        params["rho_hat"] = request.rho_hat
    if request.delta is not None:
        params["delta"] = request.delta
    warnings: list[str] = []

    def one(policy: str, gpus: int | None, static_params: dict[str, Any]) -> dict[str, Any]:
        kw = dict(params)
        if policy in STATIC_POLICIES or policy == "no_autoscale":
            # Static pools: default size is the trace's peak at K. Every other parameter goes
            # to the policy, which names any it does not take (PolicyError), never dropped.
            kw = {
                **static_params,
                "gpus": gpus if gpus is not None else _default_static_gpus(trace, profile),
            }
        elif gpus is not None and "gpus" not in kw:
            kw["gpus"] = gpus
        elif request.cold_start and "gpus" not in kw and "initial_gpus" not in kw:
            kw["warm_start"] = False  # the policy's own default start (one GPU)
        try:
            result = simulate(
                trace,
                policy,
                profile,
                boot_delay_s=request.boot_delay,
                tick_s=request.tick,
                progress=progress_bar(f"{policy} on {trace.name}"),
                resume_ms=request.resume_ms,
                **kw,
            )
        except TypeError as exc:
            if "future=" not in str(exc):
                raise
            # An oracle (the evaluation's clairvoyant policy) is told the trace it runs on.
            result = simulate(
                trace,
                policy,
                profile,
                boot_delay_s=request.boot_delay,
                tick_s=request.tick,
                progress=progress_bar(f"{policy} on {trace.name}"),
                resume_ms=request.resume_ms,
                future=trace,
                **kw,
            )
        return result.to_json(timeline=request.timeline)

    rows: list[dict[str, Any]] = []
    note = ""
    if request.policy == "all":
        rows.append(one("turboserve", None, {}))
        mean_gpus = rows[0]["cost_gpu_seconds"] / trace.duration
        if params:
            # With --policy all the autoscaling knobs are meant for the autoscalers: say so
            # instead of silently ignoring them for the static pools.
            warnings.append(
                f"note: {', '.join(sorted(params))} not given to the static pools "
                f"({', '.join(STATIC_POLICIES)}, no_autoscale)"
            )
        for name in _all_policies():
            if name == "turboserve":
                continue
            try:
                if name in STATIC_POLICIES and request.gpus is None:
                    rows.append(_at_equal_cost(name, mean_gpus, one))
                else:
                    rows.append(one(name, request.gpus if name in STATIC_POLICIES else None, {}))
            except TypeError as exc:  # e.g. a policy that needs a parameter we cannot guess
                warnings.append(f"skipped {name}: {exc}")
        if request.gpus is None:
            note = (
                f"static pools ({', '.join(STATIC_POLICIES)}) at turboserve's cost: each "
                f"figure interpolated between {math.floor(mean_gpus)} and "
                f"{math.ceil(mean_gpus)} GPUs (its mean, {mean_gpus:.2f}), as sim evaluate "
                f"matches them; no_autoscale is sized for the trace's peak"
            )
        else:
            note = f"static pools at {request.gpus} GPUs (--gpus): not matched to any cost"
    else:
        for name in (p.strip() for p in request.policy.split(",") if p.strip()):
            rows.append(one(name, request.gpus, params))
    report = RunReport(
        request=request,
        trace=trace.name,
        heading=(
            f"trace {trace.name}: {trace.duration / 60:.0f} min, {trace.sessions} sessions, "
            f"peak {trace.peak_active()} active; profile {profile.name} (K={profile.capacity}, "
            f"deadline {profile.deadline_ms:g} ms); boot delay {request.boot_delay:g} s"
        ),
        rows=rows,
        note=note,
        wall_s=sum(r["wall_s"] for r in rows),
        price=profile.price_usd_per_gpu_hour,
        profile=profile.name,
        warnings=warnings,
    )
    return report


def sweep_at_slo(report: RunReport) -> None:
    """Each row's policy swept on the trace as ``sim evaluate`` sweeps it: its cost to serve
    99% of chunk periods on time, kept in the report and in the row (``cost_at_slo``)."""
    from lab.eval.evaluate import costs_at_slo

    request = report.request
    started = time.perf_counter()
    entries = costs_at_slo(
        request.trace,
        [row["policy"] for row in report.rows],
        profile=request.profile or report.profile,
        boot_delay_s=request.boot_delay,
        jobs=request.jobs,
        progress=sys.stderr.isatty(),
    )
    for row in report.rows:
        row["cost_at_slo"] = entries[row["policy"]]
    report.at_slo = entries
    report.sweep_wall_s = time.perf_counter() - started


def _comparisons_at_slo(entries: dict[str, dict[str, Any] | None]) -> list[str]:
    """Turboserve against the best static pool and against the clairvoyant at the service
    level, as the evaluation compares them; who did not reach it, where one did not."""
    from lab.eval.service_level import gap_bound

    ours = entries.get("turboserve")
    if ours is None:
        return []
    out = []
    static = {n: e for n in STATIC_POLICIES if (e := entries.get(n)) is not None}
    if len(static) == len(STATIC_POLICIES):
        reached = {n: e for n, e in static.items() if e["reached"]}
        if reached and ours["reached"]:
            best = min(reached, key=lambda n: reached[n]["cost_gpu_hours"])
            theirs = reached[best]["cost_gpu_hours"]
            out.append(
                f"turboserve against the best static pool ({best} x "
                f"{reached[best]['gpus']}): "
                f"{100 * (ours['cost_gpu_hours'] / theirs - 1):+.1f}% cost"
            )
        else:
            who = ["turboserve"] if not ours["reached"] else list(STATIC_POLICIES)
            out.append(f"turboserve against the best static pool: not reached ({', '.join(who)})")
    clairvoyant = entries.get("clairvoyant")
    if clairvoyant is not None:
        who = [
            n for n, e in (("turboserve", ours), ("clairvoyant", clairvoyant)) if not e["reached"]
        ]
        bound = gap_bound(ours, clairvoyant)
        gap = (
            f"not reached ({', '.join(who)})"
            if who
            else f"{100 * (ours['cost_gpu_hours'] / clairvoyant['cost_gpu_hours'] - 1):+.1f}%"
            + (f" ({bound}: a cheapest run served more than the level)" if bound else "")
        )
        out.append(f"gap to the clairvoyant (our cost over its, minus 1): {gap}")
    return out


def _at_equal_cost(name: str, mean_gpus: float, one: Any) -> dict[str, Any]:
    """A static pool at a fractional GPU count: every figure linearly interpolated between the
    runs at the counts around it (the rule of the evaluation's matched comparisons), so the
    row costs what turboserve cost instead of a rounded count."""
    lo, hi = max(1, math.floor(mean_gpus)), max(1, math.ceil(mean_gpus))
    low = one(name, lo, {})
    if hi == lo:
        return {**low, "interpolated_between_gpus": [lo, hi]}
    high = one(name, hi, {})
    f = mean_gpus - lo

    def mix(a: Any, b: Any) -> Any:
        if isinstance(a, dict):
            return {k: mix(a[k], b[k]) for k in a if k in b}
        if isinstance(a, bool) or not isinstance(a, int | float):
            return a
        return a + (b - a) * f

    row: dict[str, Any] = mix(low, high)
    row["policy"] = name
    for key in (
        "migrations",
        "scale_events",
        "chunks",
        "peak_gpus",
        "sessions",
        "on_time_full",
        "on_time_reduced",
        "late",
    ):
        if key in row:
            row[key] = round(row[key])
    row["params"] = {**low.get("params", {}), "gpus": f"{mean_gpus:.2f} ({lo}-{hi})"}
    row["interpolated_between_gpus"] = [lo, hi]
    return row


def _all_policies() -> list[str]:
    from lab.sim.policies import POLICIES

    return list(POLICIES)


def _default_static_gpus(trace: Any, profile: Any) -> int:
    """A static pool sized for the trace's peak at full capacity K (the least that fits)."""
    peak: int = trace.peak_active()
    capacity: int = profile.capacity
    return max(1, math.ceil(peak / capacity))

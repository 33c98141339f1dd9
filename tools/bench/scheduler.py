"""``turboserve bench scheduler``: wall-clock time of one controller step at cluster scale.

For each cluster size G the benchmark builds a ``turboserve`` controller with G ready GPUs,
fills it with 8 active sessions per GPU (rho = 8/12, inside the band 0.7 +- 0.1; ``min_gpus``
= G so that it does not scale in while it fills), then drives a
seeded random stream of session events (arrivals, departures, active/idle flips, kept around
8 G active sessions, with phases at 10 G) and times every ``step`` with ``perf_counter``. GPUs it requests become
ready on the next event, so steps that rebalance onto a fresh GPU or consolidate for a scale-in
are in the sample too. It prints a table and optionally writes
``{"results": [{"gpus", "sessions", "decision_ms_p50", "decision_ms_p99", ...}]}``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.quantiles import quantile

if TYPE_CHECKING:
    from services.scheduler.core.types import Event

SESSIONS_PER_GPU = 8


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "scheduler", help="time one scheduler controller step at 64..1024 GPUs"
    )
    parser.add_argument(
        "--gpus", default="64,256,1024", help="comma-separated cluster sizes (default: 64,256,1024)"
    )
    parser.add_argument("--steps", type=int, default=3000, help="timed steps per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=None, help="profile name or JSON path")
    parser.add_argument(
        "--no-step-reports",
        dest="step_reports",
        action="store_false",
        help="time placement without the workers' pass-end reports (the O(1) "
        "least-loaded path); by default every GPU reports, as in the simulator",
    )
    parser.add_argument(
        "--json",
        dest="json_out",
        default=None,
        metavar="OUT",
        help="write the results as JSON here",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail
    from shared.profile import ProfileError, load_profile

    try:
        sizes = [int(x) for x in str(args.gpus).split(",") if x.strip()]
    except ValueError:
        return fail(
            "bench scheduler", f"--gpus must be comma-separated integers, got {args.gpus!r}"
        )
    if not sizes or min(sizes) < 1 or args.steps < 1:
        return fail("bench scheduler", "--gpus needs sizes >= 1 and --steps >= 1")
    if args.profile is not None:
        try:
            load_profile(args.profile)
        except (ProfileError, FileNotFoundError) as exc:
            return fail("bench scheduler", str(exc))
    step_reports = getattr(args, "step_reports", True)
    results = [bench_one(g, args.steps, args.seed, args.profile, step_reports) for g in sizes]
    print(format_table(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"results": results}, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


def bench_one(
    gpus: int, steps: int, seed: int, profile_name: str | None = None, step_reports: bool = True
) -> dict[str, Any]:
    from services.scheduler.core.config import ControllerConfig
    from services.scheduler.core.policies import LIVE_POLICIES
    from services.scheduler.core.types import Event, EventKind
    from shared.profile import load_profile

    # min_gpus = G keeps the cluster at its size while it fills (an almost empty cluster would
    # rightly scale in); above G the controller scales out and back in freely.
    profile = load_profile() if profile_name is None else load_profile(profile_name)
    policy = LIVE_POLICIES.build(
        "turboserve",
        profile,
        ControllerConfig(rho_hat=0.7, delta=0.1, initial_gpus=gpus, min_gpus=gpus),
    )
    rng = random.Random(seed)
    target = SESSIONS_PER_GPU * gpus
    active: _Bag = _Bag()
    idle: _Bag = _Bag()
    booting: list[str] = []
    t = 0.0
    counter = 0
    for _ in range(target):  # fill, untimed
        t += 0.001
        sid = f"s{counter}"
        counter += 1
        policy.step(Event(t, EventKind.ARRIVE, sid))
        active.add(sid)

    # Pass-end reports (untimed): the environment tells the controller when each GPU's current
    # pass ends, so placement takes its step-phase path (a scan of the least-loaded GPUs).
    report = policy.note_pass if step_reports else None
    pass_s = 0.2

    def _report_all(now: float) -> None:
        if report is not None:
            for gid in policy.view.gpus:
                report(gid, now + rng.uniform(0.0, pass_s))

    _report_all(t)
    times: list[float] = []
    decisions = 0
    phase = max(1, steps // 6)
    for i in range(steps):
        t += 0.05
        if report is not None and i % 4 == 0:  # a pass ends about every 0.2 s
            _report_all(t)
        # Demand swings between 8 and 10 sessions per GPU (rho 0.67 <-> 0.83) every `phase`
        # steps, so scale-outs, rebalances onto fresh GPUs and scale-in drains are timed too.
        goal = target if (i // phase) % 2 == 0 else target + target // 4
        if booting:
            event = Event(t, EventKind.GPU_READY, gpu_id=booting.pop())
        else:
            event = _next_session_event(rng, t, active, idle, goal, counter)
            if event.kind is EventKind.ARRIVE:
                counter += 1
        start = time.perf_counter()
        out = policy.step(event)
        times.append((time.perf_counter() - start) * 1e3)
        decisions += len(out)
        track_booting(booting, out)
    times.sort()
    view = policy.view
    return {
        "gpus": gpus,
        "sessions": target,
        "steps": steps,
        "decision_ms_p50": round(quantile(times, 0.50), 4),
        "decision_ms_p99": round(quantile(times, 0.99), 4),
        "decision_ms_max": round(times[-1], 4),
        "decisions_per_step": round(decisions / steps, 3),
        "step_reports": step_reports,
        "gpus_at_end": view.billed_gpus,
        "scale_events": getattr(policy, "scale_events", None),
    }


def track_booting(booting: list[str], decisions: list[Any]) -> None:
    """Keep ``booting`` (GPUs that will send GPU_READY) in step with the controller: requested
    GPUs boot, and a GPU released while booting (a cancelled request) never comes up."""
    from services.scheduler.core.types import Release, RequestGpus

    for d in decisions:
        if isinstance(d, RequestGpus):
            booting.extend(d.gpu_ids)
        elif isinstance(d, Release) and d.gpu_id in booting:
            booting.remove(d.gpu_id)


def _next_session_event(
    rng: random.Random, t: float, active: _Bag, idle: _Bag, target: int, counter: int
) -> Event:
    from services.scheduler.core.types import Event, EventKind

    below = len(active) < target
    r = rng.random()
    if below:  # grow: new session or an idle one wakes up
        if r < 0.5 or not idle:
            sid = f"s{counter}"
            active.add(sid)
            return Event(t, EventKind.ARRIVE, sid)
        sid = idle.pop_random(rng)
        active.add(sid)
        return Event(t, EventKind.ACTIVE, sid)
    sid = active.pop_random(rng)
    if r < 0.5:  # shrink: a session leaves or goes idle
        return Event(t, EventKind.DEPART, sid)
    idle.add(sid)
    return Event(t, EventKind.IDLE, sid)


class _Bag:
    """List with O(1) add and O(1) random removal (swap with the last)."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: str) -> None:
        self.items.append(item)

    def pop_random(self, rng: random.Random) -> str:
        i = rng.randrange(len(self.items))
        self.items[i], self.items[-1] = self.items[-1], self.items[i]
        return self.items.pop()


def format_table(results: list[dict[str, Any]]) -> str:
    from tools.report import markdown_table

    return markdown_table(
        ("GPUs", "sessions", "steps", "p50 ms", "p99 ms", "max ms", "decisions/step"),
        [
            (
                r["gpus"],
                r["sessions"],
                r["steps"],
                f"{r['decision_ms_p50']:.3f}",
                f"{r['decision_ms_p99']:.3f}",
                f"{r['decision_ms_max']:.3f}",
                r["decisions_per_step"],
            )
            for r in results
        ],
        align="rrrrrrr",
    )

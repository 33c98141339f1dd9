"""``turboserve sim evaluate``: the whole evaluation, from the command line.

Registered by the simulator's CLI (``lab/sim/cli.py``) on its ``sim``
subparsers. Top-level imports stay light; the work is imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sim_subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sim_subparsers.add_parser(
        "evaluate",
        help="oracles, matched comparisons, ablations, sensitivity; tables, plots and JSON",
    )
    parser.add_argument(
        "--traces",
        type=Path,
        default=None,
        help="a folder of trace CSVs (.csv / .csv.gz); default: the seven built-in traces",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--plots", type=Path, default=None, help="write PNG plots into this folder")
    parser.add_argument(
        "--quick", action="store_true", help="coarser sweeps (under 2 minutes on a 2-core machine)"
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="worker processes (default: min(2, CPUs))"
    )
    parser.add_argument(
        "--placement-instances",
        type=int,
        default=1000,
        help="random instances for the placement oracle (default 1000)",
    )
    parser.add_argument(
        "--markdown", type=Path, default=None, help="also write the markdown tables to this file"
    )
    parser.add_argument(
        "--profiles",
        default=None,
        metavar="LIST",
        help="comma-separated latency profiles (shipped names or JSON paths); "
        "default: the paper's H20 and our measured H200 "
        "(h20-longlive-1.3b-nvlink,h200-wan-1.3b-measured); the first "
        "one's figures head the report",
    )
    parser.add_argument(
        "--scale",
        default="1",
        metavar="LIST",
        help="comma-separated scales (default 1): at scale N each "
        "trace is N copies of itself superposed, each shifted by a seeded "
        "0-40 s offset (the trace <name>_xN); the first scale's figures "
        "head the report, and the JSON and markdown are written again "
        "after each scale",
    )
    parser.set_defaults(func=run)
    from lab.eval import results

    results.register(sim_subparsers)


def run(args: argparse.Namespace) -> int:
    from lab.eval.evaluate import (
        DEFAULT_PROFILES,
        Evaluation,
        evaluate_scales,
        trace_keys_from_dir,
    )
    from lab.eval.report import markdown_report, write_plots
    from lab.sim.simulator import PolicyError, SimulationError
    from lab.sim.traceio import TraceError
    from shared.cli import fail
    from shared.profile import ProfileError, load_profile

    if args.jobs is not None and args.jobs < 1:
        return fail("sim evaluate", f"--jobs must be >= 1, got {args.jobs}")
    try:
        scales = tuple(int(x) for x in args.scale.split(",") if x.strip())
    except ValueError:
        return fail(
            "sim evaluate", f"--scale takes whole numbers separated by commas, got {args.scale!r}"
        )
    if not scales or any(n < 1 for n in scales) or len(set(scales)) != len(scales):
        return fail(
            "sim evaluate", f"--scale needs distinct whole numbers >= 1, got {args.scale!r}"
        )
    try:
        if args.traces is not None:
            keys = trace_keys_from_dir(args.traces)
        else:
            from lab.sim.synth import BUILTIN_NAMES

            keys = list(BUILTIN_NAMES)
        profiles = (
            DEFAULT_PROFILES
            if args.profiles is None
            else tuple(p.strip() for p in args.profiles.split(",") if p.strip())
        )
        if not profiles:
            return fail("sim evaluate", "--profiles needs at least one profile")
        for name in profiles:
            load_profile(name)  # a bad profile is a one-line error before any work

        def write(result: Evaluation) -> None:
            # After each scale, so that a long evaluation leaves what it has measured; the
            # JSON first, so that nothing measured is lost to a report that cannot be drawn.
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result.document, indent=2) + "\n")
            if args.markdown is not None:
                args.markdown.parent.mkdir(parents=True, exist_ok=True)
                args.markdown.write_text(markdown_report(result.document))

        result = evaluate_scales(
            keys,
            profiles,
            scales,
            quick=args.quick,
            jobs=args.jobs,
            placement_instances=args.placement_instances,
            done=write,
        )
    except (TraceError, ProfileError, SimulationError, PolicyError, FileNotFoundError) as exc:
        # A bad trace file (named, with its line where known), not a traceback.
        return fail("sim evaluate", exc)
    print(markdown_report(result.document))
    if args.plots is not None:
        for path in write_plots(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    for path in (args.markdown, args.json):
        if path is not None:
            print(f"wrote {path}", file=sys.stderr)
    return 0

"""The `turboserve` command line: one entry point, a subcommand per service and tool.

Each package registers its own subcommands through a ``register(subparsers)`` function and
is imported lazily, so ``turboserve gateway`` never pays for importing torch and
``turboserve sim`` never imports NATS.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (module, attribute) pairs; each ``register(subparsers)`` adds its parsers and sets
# ``func`` (a callable taking the parsed args and returning an exit code).
_TOP_LEVEL = (
    "services.launcher",            # up
    "services.gateway.cli",         # gateway
    "services.scheduler.cli",       # scheduler
    "services.gpu_worker.cli",      # worker
    "services.provisioner.cli",     # provisioner
    "services.ctl",                 # ctl status|migrate|drain|undrain
    "services.replay",              # replay (load generator)
    "services.chaos",               # chaos (a replay while components die)
    "services.scheduler.sim.cli",   # sim traces|run|profile|evaluate
)
_BENCH = (
    "services.bench_control",       # bench control
    "services.bench_pacing",        # bench pacing
    "services.scheduler.bench",     # bench scheduler
    "services.gpu_worker.bench",    # bench worker
    "services.gpu_worker.handoff.bench",  # bench migration
    "services.gateway.bench",       # bench gateway
    "services.provisioner.bench",   # bench provisioner
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turboserve",
        description="TurboServe: serving interactive streaming video generation.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _TOP_LEVEL:
        _register(name, sub)
    bench = sub.add_parser("bench", help="benchmarks that print tables")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="TARGET")
    for name in _BENCH:
        _register(name, bench_sub)
    return parser


def _register(module_name: str, subparsers: argparse._SubParsersAction) -> None:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only tolerate the module itself being absent (a partial checkout), never a
        # missing dependency inside it.
        if exc.name != module_name:
            raise
        return
    module.register(subparsers)


def fail(command: str, message: object) -> int:
    """Report a user error of ``turboserve <command>`` in one line on stderr (no traceback);
    returns the exit code for it. Every subcommand reports bad input this way."""
    print(f"turboserve {command}: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    from shared.settings import SettingsError

    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except SettingsError as exc:
        return fail(args.command, exc)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())

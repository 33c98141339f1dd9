"""The `turboserve` command line: one entry point, a subcommand per service and tool.

Each package registers its own subcommands through a ``register(subparsers)`` function and
is imported lazily: the table below names every subcommand with its module and a one-line
help, ``turboserve --help`` lists them from the table alone, and only the module of the
subcommand being run is imported. So ``turboserve gateway`` never pays for importing torch,
``turboserve sim`` never imports NATS, and ``turboserve --help`` imports neither.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from shared.cli import fail


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: its name, the module whose ``register(subparsers)`` adds its parser
    (setting ``func``, a callable taking the parsed args and returning an exit code), and
    the help ``turboserve --help`` shows without importing that module."""

    name: str
    module: str
    help: str


# To add a subcommand: one row here, and ``register(subparsers)`` in its module, adding a
# parser of the same name (tests/tools/test_cli.py holds the two to each other).
TOP_LEVEL = (
    Subcommand("up", "tools.launcher", "run the whole mesh locally (embedded NATS/Redis if none)"),
    Subcommand(
        "gateway",
        "services.gateway.cli",
        "run the gateway: HTTP API, SSE, WebSocket, playground, dashboard (TURBOSERVE_* settings)",
    ),
    Subcommand(
        "scheduler", "services.scheduler.cli", "run the live scheduler (TURBOSERVE_* settings)"
    ),
    Subcommand("worker", "services.gpu_worker.cli", "run a GPU worker (TURBOSERVE_* settings)"),
    Subcommand(
        "frames",
        "services.gpu_worker.frames",
        "write a strip of the model's frames as a PNG (no services needed)",
    ),
    Subcommand(
        "model",
        "services.gpu_worker.model_check",
        "inspect a Wan2.1 model folder: model check FOLDER [--checkpoint FILE]",
    ),
    Subcommand(
        "provisioner", "services.provisioner.cli", "run the provisioner (TURBOSERVE_* settings)"
    ),
    Subcommand("ctl", "tools.ctl", "operator commands: status, migrate, drain, undrain, stop"),
    Subcommand(
        "replay", "tools.replay", "play a session trace against a running gateway (load generator)"
    ),
    Subcommand("chaos", "tools.chaos", "a replay while components are killed at random"),
    Subcommand("certs", "tools.certs", "write a CA and the certificates for TLS to NATS and Redis"),
    Subcommand(
        "callout-key",
        "tools.callout_key",
        "a new key for the NATS auth callout (TURBOSERVE_CALLOUT_KEY, NATS_CALLOUT_ISSUER)",
    ),
    Subcommand(
        "gpu-check",
        "tools.gpucheck",
        "the GPU path measured in one go (8 steps); --device cpu: the dry run",
    ),
    Subcommand("sim", "lab.sim.cli", "traces, the discrete-event simulator, the profiler"),
)
BENCH = (
    Subcommand("control", "tools.bench.control", "the control plane's overhead (event to command)"),
    Subcommand("pacing", "tools.bench.pacing", "sessions on one worker at their playback pace"),
    Subcommand(
        "scheduler", "tools.bench.scheduler", "time one scheduler controller step at 64..1024 GPUs"
    ),
    Subcommand(
        "worker",
        "tools.bench.worker",
        "benchmark the GPU worker's engine (chunk time per batch size)",
    ),
    Subcommand(
        "migration",
        "tools.bench.migration",
        "benchmark the session-state handoff between two worker processes",
    ),
    Subcommand(
        "gateway",
        "tools.bench.gateway",
        "SSE delivery latency (NATS publish to client receipt) with N clients",
    ),
    Subcommand(
        "stream",
        "tools.bench.stream",
        "JPEG in SSE vs fMP4 in SSE and WebSocket vs WebRTC: bytes/s, encode ms, delivery",
    ),
    Subcommand(
        "webrtc-cost",
        "tools.bench.webrtc_cost",
        "one WebRTC viewer's CPU cost to the gateway: re-encoded vs passed through",
    ),
    Subcommand(
        "provisioner", "tools.bench.provisioner", "provisioner: command round trips, worker boots"
    ),
    Subcommand(
        "v2v",
        "tools.bench.v2v",
        "video-to-video sessions on one worker: input-to-output delay, sessions at the "
        "deadline, encoder ms",
    ),
)
BENCH_HELP = "benchmarks that print tables"


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: the chosen subcommand's module registers its real parser,
    every other subcommand gets a placeholder with its help (enough for ``--help`` and for
    argparse's "invalid choice"). With ``argv`` None every module is imported: the full
    parser, for tests and tools that inspect it."""
    chosen = _positionals(argv)
    parser = argparse.ArgumentParser(
        prog="turboserve",
        description="TurboServe: serving interactive streaming video generation.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in TOP_LEVEL:
        _add(command, sub, load=argv is None or chosen[:1] == [command.name])
    bench = sub.add_parser("bench", help=BENCH_HELP)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="TARGET")
    for command in BENCH:
        _add(command, bench_sub, load=argv is None or chosen[:2] == ["bench", command.name])
    return parser


def _positionals(argv: Sequence[str] | None) -> list[str]:
    """The leading words of ``argv`` that name a subcommand (and a bench target): the top
    level and ``bench`` take no options but ``-h``, so these are its first two non-options."""
    return [word for word in (argv or ()) if not word.startswith("-")][:2]


def _add(
    command: Subcommand,
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    *,
    load: bool,
) -> None:
    if load:
        try:
            module = importlib.import_module(command.module)
        except ModuleNotFoundError as exc:
            # Only tolerate the module itself being absent (a partial checkout), never a
            # missing dependency inside it.
            if exc.name != command.module:
                raise
            return
        module.register(subparsers)
    else:
        subparsers.add_parser(command.name, help=command.help)


def main(argv: Sequence[str] | None = None) -> int:
    from shared.settings import SettingsError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        code = args.func(args)
    except SettingsError as exc:
        return fail(args.command, exc)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())

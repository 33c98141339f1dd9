"""The command line starts fast: ``turboserve --help`` lists every subcommand from its table
without importing their modules, and the services that never touch the model (gateway,
scheduler, provisioner, ctl) never import torch, neither to parse nor to run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tools.cli import BENCH, TOP_LEVEL, build_parser

# Runs ``main(argv)`` (catching argparse's exit after --help), then imports the modules the
# command would run with, and prints which heavy packages got imported.
_PROBE = """
import json, sys
from tools.cli import main
argv = json.loads(sys.argv[1])
try:
    main(argv)
except SystemExit:
    pass
for module in json.loads(sys.argv[2]):
    __import__(module)
print(json.dumps(sorted(m for m in ("torch", "numpy", "aiohttp", "nats", "redis")
                        if m in sys.modules)))
"""


def _heavy_imports(argv: list[str], run_modules: tuple[str, ...] = ()) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(list(run_modules))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_top_level_help_imports_no_subcommand_module() -> None:
    assert _heavy_imports(["--help"]) == []
    assert _heavy_imports(["bench", "--help"]) == []


@pytest.mark.parametrize(
    ("argv", "run_modules"),
    [
        (["ctl", "--help"], ("tools.ctl",)),
        (["ctl", "status", "--help"], ("tools.ctl",)),
        (["gateway", "--help"], ("services.gateway.service",)),
        (["scheduler", "--help"], ("services.scheduler.service",)),
        (
            ["provisioner", "--help"],
            ("services.provisioner.service", "services.provisioner.backends.local"),
        ),
    ],
)
def test_services_without_the_model_never_import_torch(
    argv: list[str], run_modules: tuple[str, ...]
) -> None:
    assert "torch" not in _heavy_imports(argv, run_modules)


def _choices(subparsers: argparse._SubParsersAction) -> dict[str, str | None]:
    return {action.dest: action.help for action in subparsers._choices_actions}


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_the_table_matches_what_each_module_registers() -> None:
    full = build_parser()
    top = _subparsers(full)
    assert _choices(top) == {**{c.name: c.help for c in TOP_LEVEL}, "bench": _choices(top)["bench"]}
    bench = _subparsers(top.choices["bench"])
    assert _choices(bench) == {c.name: c.help for c in BENCH}


def test_the_chosen_subcommand_gets_its_real_parser() -> None:
    args = build_parser(["ctl", "status", "--json"]).parse_args(["ctl", "status", "--json"])
    assert args.ctl_command == "status" and args.json and callable(args.func)
    argv = ["bench", "scheduler", "--gpus", "64"]
    assert build_parser(argv).parse_args(argv).gpus == "64"

"""``turboserve provisioner``: run the worker pool manager on its own."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("provisioner", help="run the provisioner (TURBOSERVE_* settings)")
    p.add_argument("--min-workers", type=int, help="workers to keep running (TURBOSERVE_MIN_WORKERS)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.provisioner.service import ProvisionerService
    from shared.runner import run_service
    from shared.settings import ProvisionerSettings

    overrides = {"min_workers": args.min_workers} if args.min_workers is not None else {}
    settings = ProvisionerSettings.from_env(**overrides)
    return run_service(lambda: ProvisionerService(settings), settings, "provisioner")

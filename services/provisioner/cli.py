"""``turboserve provisioner``: run the worker pool manager on its own."""

from __future__ import annotations

import argparse

from services.provisioner.backends.base import BackendUnavailable
from services.provisioner.backends.registry import BACKENDS, make_backend


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("provisioner", help="run the provisioner (TURBOSERVE_* settings)")
    p.add_argument(
        "--min-workers", type=int, help="workers to keep running (TURBOSERVE_MIN_WORKERS)"
    )
    p.add_argument("--max-workers", type=int, help="most workers at once (TURBOSERVE_MAX_WORKERS)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        help="where workers run: local processes or Kubernetes pods (TURBOSERVE_BACKEND)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.provisioner.service import ProvisionerService
    from shared.cli import fail
    from shared.logging import configure_logging
    from shared.runner import run_service
    from shared.settings import ProvisionerSettings

    flags = {
        "min_workers": args.min_workers,
        "max_workers": args.max_workers,
        "backend": args.backend,
    }
    settings = ProvisionerSettings.from_env(**{k: v for k, v in flags.items() if v is not None})
    # The backend logs as it is made (the GPUs it finds): in the service's format already.
    configure_logging(settings.log_level, settings.log_format, service="provisioner")
    try:
        backend = make_backend(settings)
    except BackendUnavailable as exc:
        return fail("provisioner", exc)
    return run_service(lambda: ProvisionerService(settings, backend), settings, "provisioner")

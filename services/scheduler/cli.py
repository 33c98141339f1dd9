"""``turboserve scheduler``: run the live scheduler on its own."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("scheduler", help="run the live scheduler (TURBOSERVE_* settings)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.scheduler.service import SchedulerService
    from shared.runner import run_service
    from shared.settings import SchedulerSettings

    settings = SchedulerSettings.from_env()
    return run_service(lambda: SchedulerService(settings), settings, "scheduler")

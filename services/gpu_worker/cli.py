"""``turboserve worker``: run one GPU worker (or a CPU worker where there is no GPU)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("worker", help="run a GPU worker (TURBOSERVE_* settings)")
    p.add_argument("--worker-id", help="worker id (TURBOSERVE_WORKER_ID)")
    p.add_argument("--preset", help="model preset: tiny, small, wan-1.3b (TURBOSERVE_PRESET)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N (TURBOSERVE_DEVICE)")
    p.set_defaults(func=run)


def describe_device(requested: str) -> dict[str, object]:
    """What the worker will run on, said in its first log line (no GPU: it says so)."""
    import torch

    from services.gpu_worker.telemetry import describe

    has_cuda = torch.cuda.is_available()
    device = ("cuda:0" if has_cuda else "cpu") if requested == "auto" else requested
    return {
        "device": device,
        "gpu": device.startswith("cuda"),
        "note": describe(torch.device(device)),
    }


def run(args: argparse.Namespace) -> int:
    from services.gpu_worker.service import WorkerService
    from shared.logging import configure_logging, get_logger
    from shared.runner import run_service
    from shared.settings import WorkerSettings

    overrides = {
        k: v
        for k, v in (
            ("worker_id", args.worker_id),
            ("preset", args.preset),
            ("device", args.device),
        )
        if v is not None
    }
    settings = WorkerSettings.from_env(**overrides)
    configure_logging(settings.log_level, settings.log_format, service="worker")
    get_logger("turboserve.worker").info(
        "worker_starting", worker_id=settings.worker_id, **describe_device(settings.device)
    )
    if settings.enrol:  # a user of its own first (shared/enrol.py)
        import asyncio

        from services.gpu_worker.enrol import enrol
        from shared.runner import ConnectError

        try:
            settings = asyncio.run(enrol(settings))
        except ConnectError as exc:
            get_logger("turboserve.worker").error("startup_failed", error=str(exc))
            return 2
    return run_service(lambda: WorkerService(settings), settings, "worker")

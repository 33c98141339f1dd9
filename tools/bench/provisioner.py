"""``python -m tools.bench.provisioner``: what the provisioner costs the loop, on this host.

Runs a provisioner (local backend) in-process against the NATS and Redis at
``TURBOSERVE_NATS_URL`` / ``TURBOSERVE_REDIS_URL`` (or embedded ones, as ``turboserve up``
starts them), under a subject prefix and Redis namespace of its own, and measures:

- a START and a STOP answered as NATS requests (workers held in a boot delay, so that only the
  provisioner's own work is timed: registry reads, metering, events, the reply);
- real ``tiny`` CPU workers: from the request to their first READY heartbeat (boot), and from
  the STOP's reply to the GONE event (a clean shutdown).

Prints a table; ``--json OUT`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from shared.quantiles import quantiles


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("provisioner", help="provisioner: command round trips, worker boots")
    _arguments(p)
    p.set_defaults(func=run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--commands", type=int, default=200, help="START/STOP pairs to time (200)")
    p.add_argument("--workers", type=int, default=2, help="real CPU workers to boot (2)")
    p.add_argument("--json", type=Path, help="write the figures here")


def run(args: argparse.Namespace) -> int:
    if args.commands < 1 or args.workers < 0:
        print("bench provisioner: --commands >= 1 and --workers >= 0", file=sys.stderr)
        return 2
    from shared.logging import configure_logging
    from tools.launcher import Mesh

    configure_logging("warning", "console", service="bench")
    mesh = Mesh.from_env(quiet=True)
    mesh.start_infra()
    try:
        figures = asyncio.run(_bench(mesh.nats_url, mesh.redis_url, args.commands, args.workers))
    finally:
        mesh.stop()
    _print(figures)
    if args.json:
        args.json.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    return 0


async def _bench(nats_url: str, redis_url: str, commands: int, workers: int) -> dict[str, Any]:
    from services.provisioner.service import ProvisionerService
    from shared.runner import running, subscriptions_live
    from shared.settings import ProvisionerSettings
    from shared.wire import (
        ProvisionerCmdKind,
        ProvisionerCommand,
        ProvisionerEvent,
        ProvisionerReply,
        WorkerStatus,
        decode,
        encode,
    )

    tag = "bench" + uuid.uuid4().hex[:8]
    env = {
        "TURBOSERVE_NATS_URL": nats_url,
        "TURBOSERVE_REDIS_URL": redis_url,
        "TURBOSERVE_SUBJECT_PREFIX": tag,
        "TURBOSERVE_REDIS_NAMESPACE": tag,
        "TURBOSERVE_GPUS": "none",
        "TURBOSERVE_METRICS_PORT": "-1",
    }
    seen: dict[tuple[str, WorkerStatus], float] = {}
    changed = asyncio.Event()

    async def on_event(msg: Any) -> None:
        event = decode(msg.subject, msg.data, ProvisionerEvent)
        seen.setdefault((event.worker_id, event.status), time.perf_counter())
        changed.set()

    async def wait(worker_id: str, status: WorkerStatus, timeout_s: float = 300.0) -> float:
        deadline = time.perf_counter() + timeout_s
        while (worker_id, status) not in seen:
            changed.clear()
            await asyncio.wait_for(changed.wait(), timeout=max(0.0, deadline - time.perf_counter()))
        return seen[(worker_id, status)]

    async def ask(nc: Any, subjects: Any, kind: ProvisionerCmdKind, ids: list[str]) -> float:
        t0 = time.perf_counter()
        msg = await nc.request(
            subjects.provisioner_cmd,
            encode(ProvisionerCommand(kind=kind, worker_ids=ids)),
            timeout=30,
        )
        reply = decode(msg.subject, msg.data, ProvisionerReply)
        if not reply.ok:
            raise RuntimeError(f"{kind} {ids} refused: {reply.refused}")
        return (time.perf_counter() - t0) * 1000.0

    start_ms: list[float] = []
    stop_ms: list[float] = []
    settings = ProvisionerSettings.from_env(
        env, min_workers=0, max_workers=max(1, workers), boot_delay_s=3600.0, boot_timeout_s=7200.0
    )
    async with running(ProvisionerService(settings), settings) as ctx:
        for i in range(commands):
            start_ms.append(await ask(ctx.nc, ctx.subjects, ProvisionerCmdKind.START, [f"c{i}"]))
            stop_ms.append(await ask(ctx.nc, ctx.subjects, ProvisionerCmdKind.STOP, [f"c{i}"]))

    boot_ms: list[float] = []
    release_ms: list[float] = []
    if workers:
        settings = settings.replace(boot_delay_s=0.0)
        async with running(ProvisionerService(settings), settings) as ctx:
            await ctx.nc.subscribe(ctx.subjects.provisioner_events, cb=on_event)
            await subscriptions_live(ctx.nc)
            ids = [f"w{i}" for i in range(workers)]
            asked = time.perf_counter()
            await ask(ctx.nc, ctx.subjects, ProvisionerCmdKind.START, ids)
            for wid in ids:
                boot_ms.append((await wait(wid, WorkerStatus.READY) - asked) * 1000.0)
            for wid in ids:
                t0 = time.perf_counter()
                await ask(ctx.nc, ctx.subjects, ProvisionerCmdKind.STOP, [wid])
                release_ms.append((await wait(wid, WorkerStatus.GONE) - t0) * 1000.0)
        await _forget(redis_url, tag)
    else:
        await _forget(redis_url, tag)
    return {
        "host_cpus": os.cpu_count(),
        "rows": {
            "START request -> reply (no process)": _row(start_ms),
            "STOP request -> reply (no process)": _row(stop_ms),
            "tiny CPU worker: request -> first READY": _row(boot_ms),
            "tiny CPU worker: STOP reply -> GONE": _row(release_ms),
        },
    }


async def _forget(redis_url: str, namespace: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    keys = [k async for k in client.scan_iter(match=f"{namespace}:*", count=500)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def _print(figures: dict[str, Any]) -> None:
    print("| measure | n | p50 ms | p99 ms | max ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, row in figures["rows"].items():
        print(
            f"| {name} | {row['n']} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['max_ms']:.1f} |"
        )


def _row(samples_ms: Sequence[float]) -> dict[str, float | int]:
    if not samples_ms:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    p50, p99, top = quantiles(samples_ms, (0.5, 0.99, 1.0))
    return {"n": len(samples_ms), "p50_ms": p50, "p99_ms": p99, "max_ms": top}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.provisioner", description=__doc__.splitlines()[0]
    )
    _arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

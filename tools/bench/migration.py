"""``turboserve bench migration``: a session's state handed between two worker processes on
this machine, through the real protocol (registry CAS, offer, transfer, verify, commit), for
each state size; with the bandwidth of a raw loopback socket copy of the same bytes in the
same run next to it.

Two stand-in workers (``python -m tools.handoff.peer``: a ``HandoffEndpoint``
over a synthetic state host) move one session back and forth per size. Uses the NATS and
Redis at ``TURBOSERVE_NATS_URL`` / ``TURBOSERVE_REDIS_URL`` when they answer, else starts its
own (as ``turboserve up`` does). ``--device cuda`` puts the state on the GPU: both processes on
``cuda:0`` move it by CUDA IPC; with two GPUs (``--devices cuda:0,cuda:1``) by NCCL.

Timing (the source's clock): ``handoff`` is the whole command, ``fixed`` the part that does not
grow with the state (registry CAS, offer/answer, the destination's verify + commit CAS + adopt,
and the outcome message), ``transfer`` the bytes. The first handoff in each direction builds
the communicator; that first-use cost is reported apart and left out of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.report import BenchUsageError

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from shared.wire import MigrationReport
    from tools.handoff.harness import Reports

MIB = 1 << 20
BAR_SIZE_MIB = 64  # the bandwidth bar applies from this size up
BAR_BANDWIDTH = 0.5  # transfer >= half the raw copy's bandwidth
BAR_FIXED_MS = 5.0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "migration",
        help="benchmark the session-state handoff between two worker processes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="1,64,256", help="state sizes in MiB, comma-separated")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--devices",
        default=None,
        help="the two workers' devices, e.g. cuda:0,cuda:1 (default: both on --device)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed handoffs per size")
    parser.add_argument("--layers", type=int, default=8, help="tensors the state is split into")
    parser.add_argument("--transport", default="auto", help="auto, gloo, nccl or cuda_ipc")
    parser.add_argument(
        "--checksum",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="offers carry the state's keyed checksum, which the destination verifies (the "
        "default, as in the worker); --no-checksum measures the handoff without it",
    )
    parser.add_argument("--json", dest="json_out", default=None, help="write results here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.cli import fail

    try:
        options = _options(args)
    except BenchUsageError as exc:
        return fail("bench migration", exc)
    report = asyncio.run(run_benchmark(**options))
    print_table(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


def _options(args: argparse.Namespace) -> dict[str, Any]:
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise BenchUsageError(
            f"--sizes must be MiB numbers, comma-separated, got {args.sizes!r}"
        ) from None
    if not sizes or min(sizes) <= 0:
        raise BenchUsageError(f"--sizes needs sizes > 0 MiB, got {args.sizes!r}")
    if args.repeats < 1:
        raise BenchUsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.layers < 1:
        raise BenchUsageError(f"--layers must be >= 1, got {args.layers}")
    if args.transport not in ("auto", "gloo", "nccl", "cuda_ipc"):
        raise BenchUsageError(
            f"--transport must be auto, gloo, nccl or cuda_ipc, got {args.transport!r}"
        )
    devices = (args.devices or f"{args.device},{args.device}").split(",")
    if len(devices) != 2:
        raise BenchUsageError(f"--devices needs two devices, got {args.devices!r}")
    devices = [_check_device(d.strip()) for d in devices]
    return {
        "sizes_mib": sizes,
        "devices": devices,
        "repeats": args.repeats,
        "layers": args.layers,
        "transport": args.transport,
        "checksum": args.checksum,
    }


def _check_device(name: str) -> str:
    import torch

    if name == "cpu":
        return name
    if not name.startswith("cuda"):
        raise BenchUsageError(f"--device must be cpu or cuda[:N], got {name!r}")
    if not torch.cuda.is_available():
        raise BenchUsageError(f"--device {name}: no CUDA GPU is available here (use --device cpu)")
    device = torch.device(name)
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise BenchUsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


# -- the run ------------------------------------------------------------------------------


@dataclass
class _Pair:
    a: str
    b: str
    procs: list[subprocess.Popen[bytes]]


async def run_benchmark(
    sizes_mib: list[float],
    devices: list[str],
    repeats: int,
    layers: int,
    transport: str,
    checksum: bool,
) -> dict[str, Any]:
    import nats
    import redis.asyncio as aioredis

    from shared.registry import Registry
    from shared.wire import Subjects
    from tools.handoff import harness
    from tools.launcher import Mesh

    mesh = Mesh.from_env(quiet=True)
    mesh.start_infra()
    tag = "bench" + uuid.uuid4().hex[:8]
    subjects = Subjects(tag)
    env = {
        "TURBOSERVE_NATS_URL": mesh.nats_url,
        "TURBOSERVE_REDIS_URL": mesh.redis_url,
        "TURBOSERVE_SUBJECT_PREFIX": tag,
        "TURBOSERVE_REDIS_NAMESPACE": tag,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_HANDOFF_TRANSPORT": transport,
        "TURBOSERVE_HANDOFF_TIMEOUT_S": "120",
    }
    pair = _Pair(f"{tag}-a", f"{tag}-b", [])
    redis = aioredis.from_url(mesh.redis_url)
    nc = await nats.connect(mesh.nats_url)
    try:
        for worker, device in zip((pair.a, pair.b), devices, strict=True):
            pair.procs.append(harness.spawn_peer(worker, env, device=device, checksum=checksum))
        for worker, proc in zip((pair.a, pair.b), pair.procs, strict=True):
            await harness.wait_ready(nc, subjects, worker, proc)
        reports = harness.Reports(nc, subjects)
        await reports.start()
        registry = Registry(redis, tag)
        results, first_use = [], []
        for n, mib in enumerate(sizes_mib):
            nbytes = int(mib * MIB)
            session = f"s{n}"
            layout = f"bytes={nbytes} layers={layers}"
            epoch = await harness.place(registry, nc, subjects, session, pair.a, layout, seed=n)
            done, epoch, first = await _shuttle(reports, session, pair, epoch, repeats)
            first_use.extend(first)
            results.append(_summarise(done, raw_copy_gbps(done[0].nbytes, repeats)))
        await reports.close()
    finally:
        await nc.close()
        await _cleanup(redis, tag)
        for proc in pair.procs:
            proc.terminate()
        for proc in pair.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        mesh.stop()
    return {
        "results": results,
        "first_use_ms": first_use[0] if first_use else 0.0,
        "first_use_ms_each": first_use,
        "devices": devices,
        "transport": results[0]["transport"] if results else transport,
        "checksum": checksum,
        "repeats": repeats,
        "layers": layers,
    }


async def _shuttle(
    reports: Reports, session: str, pair: _Pair, epoch: int, repeats: int
) -> tuple[list[MigrationReport], int, list[float]]:
    """One warm-up round trip, then ``repeats`` timed handoffs back and forth."""
    from tools.handoff.harness import HarnessError

    done: list[MigrationReport] = []
    first_use: list[float] = []
    holder, other = pair.a, pair.b
    for i in range(2 + repeats):
        report = await reports.migrate(session, holder, other, epoch, wait_s=180.0)
        if not report.ok:
            raise HarnessError(f"handoff {holder} -> {other} failed: {report.code} {report.detail}")
        if report.connect_ms > 0:
            first_use.append(report.connect_ms)
        if i >= 2:
            done.append(report)
        epoch, holder, other = report.epoch, other, holder
    return done, epoch, first_use


def _summarise(done: list[MigrationReport], raw_gbps: float) -> dict[str, Any]:
    def p50(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    nbytes = done[0].nbytes
    transfer_ms = p50([r.transfer_ms for r in done])
    transfer_gbps = nbytes / (transfer_ms / 1000.0) / 1e9 if transfer_ms > 0 else 0.0
    bandwidth_ratio = round(transfer_gbps / raw_gbps, 3) if raw_gbps else 0.0
    fixed_ms = p50([r.offer_ms + r.commit_ms for r in done])
    row: dict[str, Any] = {
        "state_bytes": nbytes,
        "handoff_ms_p50": p50([r.total_ms for r in done]),
        "transfer_gbps": round(transfer_gbps, 3),
        "raw_copy_gbps": round(raw_gbps, 3),
        "fixed_ms_p50": fixed_ms,
        "freeze_ms_p50": p50([r.freeze_ms for r in done]),
        "offer_ms_p50": p50([r.offer_ms for r in done]),
        "transfer_ms_p50": transfer_ms,
        "commit_ms_p50": p50([r.commit_ms for r in done]),
        "handoffs": len(done),
        "transport": done[0].transport,
    }
    row["bandwidth_ratio"] = bandwidth_ratio
    if nbytes >= BAR_SIZE_MIB * MIB:
        row["meets_bandwidth_bar"] = bandwidth_ratio >= BAR_BANDWIDTH
    row["meets_fixed_bar"] = fixed_ms < BAR_FIXED_MS
    return row


async def _cleanup(redis: aioredis.Redis, namespace: str) -> None:
    keys = [k async for k in redis.scan_iter(match=f"{namespace}:*", count=500)]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


def raw_copy_gbps(nbytes: int, repeats: int) -> float:
    """Median bandwidth (GB/s) of copying ``nbytes`` over a loopback TCP socket into a
    preallocated buffer, receiver in another thread, one acknowledgement byte per copy."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = memoryview(bytearray(nbytes))

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(repeats):
                got = 0
                while got < nbytes:
                    k = conn.recv_into(received[got:], min(nbytes - got, 4 * MIB))
                    if not k:
                        return
                    got += k
                conn.sendall(b"k")

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    source = bytearray(nbytes)
    times = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(repeats):
            started = time.perf_counter()
            conn.sendall(source)
            conn.recv(1)
            times.append(time.perf_counter() - started)
    thread.join(timeout=10)
    server.close()
    return nbytes / statistics.median(times) / 1e9


def print_table(report: dict[str, Any]) -> None:
    print(
        f"session-state handoff between two processes ({', '.join(report['devices'])}; "
        f"transport {report['transport']}; {report['repeats']} handoffs per size, p50)"
    )
    header = (
        "state MiB",
        "handoff ms",
        "fixed ms",
        "transfer ms",
        "transfer GB/s",
        "raw copy GB/s",
        "ratio",
        "bars",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" ---: " for _ in header) + "|")
    for row in report["results"]:
        bars = ["fixed ok" if row["meets_fixed_bar"] else "FIXED > 5 ms"]
        if "meets_bandwidth_bar" in row:
            bars.append("bw ok" if row["meets_bandwidth_bar"] else "BW < 1/2 raw")
        cells = (
            f"{row['state_bytes'] / MIB:g}",
            f"{row['handoff_ms_p50']:.2f}",
            f"{row['fixed_ms_p50']:.2f}",
            f"{row['transfer_ms_p50']:.2f}",
            f"{row['transfer_gbps']:.2f}",
            f"{row['raw_copy_gbps']:.2f}",
            f"{row['bandwidth_ratio']:.2f}",
            ", ".join(bars),
        )
        print("| " + " | ".join(cells) + " |")
    print(
        f"first use (building the communicator): {report['first_use_ms']:.1f} ms "
        f"(each direction: {', '.join(f'{x:.1f}' for x in report['first_use_ms_each'])})"
    )

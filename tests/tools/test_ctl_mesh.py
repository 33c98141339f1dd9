"""Which mesh ``turboserve ctl`` talks to, and how fast it says that one does not answer: the
flags, the environment and ``turboserve up``'s state file, never a default address; a line
saying which mesh when it is not the state file's; one line within about 2 s when none
answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.servers import free_port

pytestmark = pytest.mark.integration

# Start-up of the interpreter and ctl's imports, on top of the 2 s connect budget, on a
# loaded two-core machine.
ANSWER_WITHIN_S = 4.0


def ctl(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "ctl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, time.monotonic() - started


@pytest.fixture
def bare_env(isolation) -> dict[str, str]:
    """The environment with no TURBOSERVE_* address in it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURBOSERVE_")}
    return {**env, **isolation}


def write_state(directory: Path, nats_url: str, redis_url: str, isolation: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "pid": os.getpid(),
        "nats_url": nats_url,
        "redis_url": redis_url,
        "subject_prefix": isolation["TURBOSERVE_SUBJECT_PREFIX"],
        "redis_namespace": isolation["TURBOSERVE_REDIS_NAMESPACE"],
    }
    (directory / "up.json").write_text(json.dumps(state))


def test_without_a_state_file_or_an_address_there_is_no_mesh_to_talk_to(bare_env, tmp_path):
    proc, took = ctl("status", "--state-dir", str(tmp_path), env=bare_env)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert "no mesh to talk to" in line and str(tmp_path) in line and "--nats-url" in line
    assert took < ANSWER_WITHIN_S


@pytest.mark.parametrize("down", ["nats", "redis"])
def test_a_mesh_that_does_not_answer_is_one_line_within_about_two_seconds(
    down, infra, bare_env, tmp_path
):
    closed = free_port()
    nats_url = f"nats://127.0.0.1:{closed}" if down == "nats" else infra.nats_url
    redis_url = f"redis://127.0.0.1:{closed}/0" if down == "redis" else infra.redis_url
    proc, took = ctl(
        "--state-dir",
        str(tmp_path),
        "status",
        "--nats-url",
        nats_url,
        "--redis-url",
        redis_url,
        env=bare_env,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert f"could not connect to {down} within 2s: " in line and str(closed) in line
    assert "is the mesh running?" in line and "from --nats-url and --redis-url" in line
    assert not line.split("within 2s: ", 1)[1].startswith(";")  # the reason is not empty
    assert took < ANSWER_WITHIN_S


def test_ctl_says_which_mesh_it_talks_to_when_not_the_state_files(
    infra, bare_env, isolation, tmp_path, redis_client
):
    # The state file's mesh: nothing said, and the addresses come from it alone.
    write_state(tmp_path / "up", infra.nats_url, infra.redis_url, isolation)
    proc, _ = ctl("status", "--json", "--state-dir", str(tmp_path / "up"), env=bare_env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and json.loads(proc.stdout)["workers"] == []

    # Another address than the state file's (the same servers, by another name).
    other = infra.nats_url.replace("127.0.0.1", "localhost")
    proc, _ = ctl("status", "--state-dir", str(tmp_path / "up"), "--nats-url", other, env=bare_env)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"talking to NATS {other}" in line and "not the mesh `turboserve up` runs" in line

    # No state file: the environment's mesh, said so.
    env = {
        **bare_env,
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
    }
    proc, _ = ctl("status", "--state-dir", str(tmp_path / "none"), env=env)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "from TURBOSERVE_NATS_URL and TURBOSERVE_REDIS_URL" in line
    assert "no `turboserve up` runs from" in line


def test_status_into_a_pipe_closed_early_ends_without_a_traceback(
    infra, bare_env, isolation, redis_client
):
    """`ctl status --json | head -1`: the reader goes away before ctl has written it all."""
    env = {
        **bare_env,
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
    }
    # Enough workers that the JSON outgrows a pipe's buffer, so the write meets the closed end.
    ns = isolation["TURBOSERVE_REDIS_NAMESPACE"]
    ids = [f"w{i:04d}" for i in range(400)]
    import redis

    client = redis.Redis.from_url(infra.redis_url)
    try:
        client.sadd(f"{ns}:workers", *ids)
        for wid in ids:
            client.hset(f"{ns}:worker:{wid}", mapping={"status": "ready", "capacity": 12})
    finally:
        client.close()
    proc = subprocess.run(
        f"{sys.executable} -m tools.cli ctl status --json | head -1",
        shell=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "{"
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


async def test_status_pending_counts_only_sessions_waiting_for_a_worker(redis_client, isolation):
    """A pending session its gateway holds idle (no viewer) or paused waits for its viewer,
    as the scheduler counts it: `ctl status` lists it apart, not as waiting for a worker."""
    from shared.registry import Registry
    from tools.ctl import Ctl, format_status

    ns = isolation["TURBOSERVE_REDIS_NAMESPACE"]
    registry = Registry(redis_client, ns)
    for sid in ("watched", "unwatched", "paused"):
        await registry.create_session(sid, "p", 0)
    await redis_client.hset(
        f"{ns}:gw:activity", mapping={"watched": "active", "unwatched": "idle", "paused": "paused"}
    )

    class Ctx:
        pass

    ctx = Ctx()
    ctx.registry = registry  # type: ignore[attr-defined]
    status = await Ctl(ctx).status()
    assert status["pending"] == ["watched"]
    assert sorted(status["pending_unwatched"]) == ["paused", "unwatched"]
    text = format_status(status)
    assert "pending: 1 session(s) waiting for a worker" in text
    assert "unwatched: 2 session(s)" in text


async def test_status_tells_an_operators_drain_from_the_schedulers_release(redis_client, isolation):
    """Both are `draining` on the worker: the operator's is `drained` once empty, the
    scheduler's own scale-in is `releasing` (the scheduler's `releasing` count)."""
    from shared.registry import Registry, WorkerRecord
    from shared.wire import WorkerStatus
    from tools.ctl import Ctl

    registry = Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    for wid in ("held", "released"):
        await registry.register_worker(WorkerRecord(wid, WorkerStatus.DRAINING, 12), ttl_s=30)
    await registry.set_operator_drain("held", "hold")

    class Ctx:
        pass

    ctx = Ctx()
    ctx.registry = registry  # type: ignore[attr-defined]
    status = {w["id"]: w["status"] for w in (await Ctl(ctx).status())["workers"]}
    assert status == {"held": "drained", "released": "releasing"}

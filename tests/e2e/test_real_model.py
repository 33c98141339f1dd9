"""A tiny Wan2.1 model folder, in each layout users download, served end to end by the mesh as
`turboserve up` runs it (``TURBOSERVE_MODEL``): umT5 from transformers, the Wan VAE from
diffusers, the DiT from the folder. One session, watched over SSE the whole time, has its prompt
changed, is migrated to the other worker, then its worker is killed: its frames stay at the
folder's resolution and its chunks continue, consecutive, across each event."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
from pathlib import Path

import aiohttp
import orjson
import pytest
from PIL import Image

from shared.wire import WorkerStatus
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context
from tests.models import RESOLUTION, build_folder
from tools.ctl import Ctl
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Stream:
    """One SSE connection read in the background: every chunk's seq, frame count and size,
    and the lifecycle notices."""

    def __init__(self) -> None:
        self.chunks: list[dict] = []
        self.notices: list[str] = []

    async def read(self, resp: aiohttp.ClientResponse) -> None:
        event: dict[str, str] = {}
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line:
                field, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if field == "data" and "data" in event:  # an event's lines, joined
                    value = event["data"] + "\n" + value
                event[field] = value
                continue
            if event.get("event") == "chunk":
                data = orjson.loads(event["data"])
                image = Image.open(io.BytesIO(base64.b64decode(data["frames"][0])))
                self.chunks.append(
                    {
                        "seq": data["seq"],
                        "frames": len(data["frames"]),
                        "size": (data["height"], data["width"]),
                        "image": (image.height, image.width),
                    }
                )
            elif event.get("event") == "state":
                self.notices.append(orjson.loads(event["data"]).get("kind", ""))
            elif event.get("event") == "end":
                return
            event = {}


def _worker_pid(mesh: Mesh, worker_id: str) -> int:
    provisioner = next(p for name, p in mesh.procs if name == "provisioner")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().split()[3]) != provisioner.pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if f"TURBOSERVE_WORKER_ID={worker_id}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process for worker {worker_id}")


def _logs(folder: Path) -> str:
    tails = [f"{p.name}: ...{p.read_text()[-1500:]}" for p in sorted(folder.glob("*.log"))]
    return "two workers never came up; logs:\n" + "\n".join(tails)


@pytest.mark.parametrize("layout", ["diffusers", "original"])
async def test_a_model_folder_streams_across_prompt_migration_and_a_killed_worker(
    layout, infra, isolation, nats_client, tmp_path
):
    folder = build_folder(tmp_path / layout, layout)
    env = {
        **isolation,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_MODEL": str(folder),
        "TURBOSERVE_RESOLUTION": f"{RESOLUTION[0]}x{RESOLUTION[1]}",
        "TURBOSERVE_CHUNK_PERIOD_S": "0.8",
        "TURBOSERVE_MAX_WORKERS": "2",
    }
    (tmp_path / "logs").mkdir()
    mesh = Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=2,
        embedded="never",
        env=env,
        quiet=True,
        log_dir=tmp_path / "logs",
    )
    mesh.start(ready_timeout=180)
    conn = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        **isolation,
    }
    try:
        async with mesh_context(conn) as (ctx, _), aiohttp.ClientSession(mesh.gateway_url) as http:

            async def two_ready() -> bool:
                ready = [
                    w
                    for w in await ctx.registry.workers()
                    if w.alive and w.status is WorkerStatus.READY
                ]
                assert len(ready) >= 2, _logs(tmp_path / "logs")
                return True

            await eventually(two_ready, 180, "two workers ready", interval=0.5)
            resp = await http.post(
                "/v1/sessions", json={"prompt": "a red fox running through snow", "seed": 5}
            )
            assert resp.status == 201, await resp.text()
            session = await resp.json()
            sid, auth = session["id"], {"Authorization": f"Bearer {session['token']}"}
            stream = Stream()
            async with http.get(
                session["stream_url"],
                params={"from": "start"},
                headers=auth,
                timeout=aiohttp.ClientTimeout(total=None),
            ) as sse:
                reader = asyncio.ensure_future(stream.read(sse))
                try:
                    await eventually(lambda: len(stream.chunks) >= 3, 120, "first chunks")
                    resp = await http.post(
                        f"/v1/sessions/{sid}/prompt",
                        headers=auth,
                        json={"prompt": "a blue whale in the deep ocean"},
                    )
                    assert resp.status == 200 and (await resp.json())["confirmed"]
                    await eventually(
                        lambda: len(stream.chunks) >= 6, 60, "chunks after the prompt change"
                    )

                    owner = (await ctx.registry.get_session(sid)).owner
                    others = [
                        w.id for w in await ctx.registry.workers() if w.alive and w.id != owner
                    ]
                    report = await Ctl(ctx).migrate(sid, others[0], 60)
                    assert report["ok"] and report["dst"] == others[0]
                    moved_at = len(stream.chunks)
                    await eventually(
                        lambda: len(stream.chunks) >= moved_at + 3, 60, "chunks after the migration"
                    )

                    os.kill(_worker_pid(mesh, others[0]), signal.SIGKILL)
                    killed_at = len(stream.chunks)
                    await eventually(
                        lambda: len(stream.chunks) >= killed_at + 3,
                        120,
                        "chunks after the worker was killed",
                    )
                finally:
                    reader.cancel()
            await http.delete(f"/v1/sessions/{sid}", headers=auth)
    finally:
        mesh.stop()

    seqs = [c["seq"] for c in stream.chunks]
    assert seqs == list(range(len(seqs))), seqs  # nothing lost or repeated across the events
    assert all(c["size"] == RESOLUTION and c["image"] == RESOLUTION for c in stream.chunks)
    # The Wan VAE: 9 frames for a stream's first 3 latent frames, then 12 per chunk.
    assert [c["frames"] for c in stream.chunks[:3]] == [9, 12, 12]
    assert "recovered" in stream.notices, stream.notices  # rebuilt from its log, not restarted

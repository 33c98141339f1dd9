"""The video at the model's own resolution reaches every kind of viewer: a tiny Wan2.1 folder
(diffusers layout) served by the mesh as `turboserve up` runs it, with nothing set but
``TURBOSERVE_MODEL`` (and two workers, to migrate between), so it runs at Wan2.1's 480x832.

One session is watched the whole time by four viewers, one of each kind: SSE ``jpeg`` (read by
a stock aiohttp client: default buffer, line by line), SSE ``fmp4``, a WebSocket (JPEG) and a
WebRTC peer (aiortc). Its prompt is changed, then it is migrated to the other worker. Every
viewer gets chunks at 480x832, the seq-numbered ones consecutive across both events, and no
worker logs a chunk it could not publish."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import struct
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from PIL import Image

from services.gpu_worker.fmp4 import decode_fragment
from shared.wire import WorkerStatus
from tests.eventually import eventually
from tests.gateway.test_webrtc import Client
from tests.gpu_worker.worker_harness import mesh_context
from tests.models import build_folder
from tools.ctl import Ctl
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NATIVE = (480, 832)  # Wan2.1's: what a loaded model runs at with no TURBOSERVE_RESOLUTION


class Viewer:
    """What one viewer got: each chunk's seq and picture size (height, width), the notices."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.chunks: list[tuple[int, tuple[int, int]]] = []
        self.notices: list[str] = []

    @property
    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.chunks]


async def read_sse(resp: aiohttp.ClientResponse, viewer: Viewer, fmt: str) -> None:
    """A stock client's way: ``resp.content`` line by line (aiohttp's default line limit)."""
    event: dict[str, str] = {}
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data" and "data" in event:  # an event's lines, joined as SSE says
                value = event["data"] + "\n" + value
            event[field] = value
            continue
        if event.get("event") == "chunk":
            data = orjson.loads(event["data"])
            if fmt == "jpeg":
                image = Image.open(io.BytesIO(base64.b64decode(data["frames"][0])))
                size = (image.height, image.width)
            else:
                frames, _ = decode_fragment(base64.b64decode(data["fragment"]))
                size = tuple(frames.shape[1:3])
            assert (data["height"], data["width"]) == size
            viewer.chunks.append((data["seq"], size))
        elif event.get("event") == "state":
            viewer.notices.append(orjson.loads(event["data"])["kind"])
        elif event.get("event") == "end":
            return
        event = {}


async def read_ws(ws: aiohttp.ClientWebSocketResponse, viewer: Viewer) -> None:
    async for msg in ws:
        if msg.type is aiohttp.WSMsgType.BINARY:
            (n,) = struct.unpack(">I", msg.data[:4])
            header = orjson.loads(msg.data[4 : 4 + n])
            first = msg.data[4 + n : 4 + n + header["frame_sizes"][0]]
            image = Image.open(io.BytesIO(first))
            assert (header["height"], header["width"]) == (image.height, image.width)
            viewer.chunks.append((header["seq"], (image.height, image.width)))
        elif msg.type is aiohttp.WSMsgType.TEXT:
            body = orjson.loads(msg.data)
            if body["type"] == "state":
                viewer.notices.append(body["kind"])
        else:
            return


async def read_track(track: Any, sizes: list[tuple[int, int]]) -> None:
    while True:
        frame = await track.recv()
        sizes.append((frame.height, frame.width))


def _logs(folder: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(folder.glob("*.log")))


async def test_every_viewer_kind_gets_the_native_resolution_across_a_prompt_and_a_migration(
    infra, isolation, nats_client, tmp_path
):
    folder = build_folder(tmp_path / "wan", light_vae=True)
    env = {
        **isolation,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_MODEL": str(folder),
        "TURBOSERVE_MAX_WORKERS": "2",
    }
    logs = tmp_path / "logs"
    logs.mkdir()
    mesh = Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=2,
        embedded="never",
        env=env,
        quiet=True,
        log_dir=logs,
    )
    mesh.start(ready_timeout=180)
    conn = {"TURBOSERVE_NATS_URL": infra.nats_url, "TURBOSERVE_REDIS_URL": infra.redis_url}
    jpeg, fmp4, socket = Viewer("sse jpeg"), Viewer("sse fmp4"), Viewer("ws")
    rtc_sizes: list[tuple[int, int]] = []
    rtc = Client()
    try:
        async with (
            mesh_context({**conn, **isolation}) as (ctx, _),
            aiohttp.ClientSession(mesh.gateway_url) as http,
        ):

            async def two_ready() -> bool:
                ready = [
                    w
                    for w in await ctx.registry.workers()
                    if w.alive and w.status is WorkerStatus.READY
                ]
                return len(ready) >= 2

            await eventually(two_ready, 180, "two workers ready", interval=0.5)
            resp = await http.post("/v1/sessions", json={"prompt": "a red fox in snow", "seed": 3})
            assert resp.status == 201, await resp.text()
            session = await resp.json()
            sid, auth = session["id"], {"Authorization": f"Bearer {session['token']}"}
            forever = aiohttp.ClientTimeout(total=None)
            start = {"from": "start"}
            async with (
                http.get(session["stream_url"], params=start, headers=auth, timeout=forever) as a,
                http.get(
                    session["stream_url"],
                    params={**start, "format": "fmp4"},
                    headers=auth,
                    timeout=forever,
                ) as b,
                http.ws_connect(session["ws_url"], params=start, headers=auth) as ws,
            ):
                answer = await rtc.connect(http, f"/v1/sessions/{sid}/webrtc", session["token"])
                assert answer["video"]["pass_through"]
                track = await asyncio.wait_for(rtc.tracks.get(), 30)
                readers = [
                    asyncio.ensure_future(read_sse(a, jpeg, "jpeg")),
                    asyncio.ensure_future(read_sse(b, fmp4, "fmp4")),
                    asyncio.ensure_future(read_ws(ws, socket)),
                    asyncio.ensure_future(read_track(track, rtc_sizes)),
                ]
                viewers = (jpeg, fmp4, socket)
                try:

                    def each_has(n: int) -> bool:
                        return all(len(v.chunks) >= n for v in viewers)

                    await eventually(lambda: each_has(2), 180, "first chunks to every viewer")
                    resp = await http.post(
                        f"/v1/sessions/{sid}/prompt", headers=auth, json={"prompt": "a whale"}
                    )
                    assert resp.status in (200, 202), await resp.text()
                    await eventually(lambda: each_has(4), 120, "chunks after the prompt change")
                    owner = (await ctx.registry.get_session(sid)).owner
                    other = next(
                        w.id for w in await ctx.registry.workers() if w.alive and w.id != owner
                    )
                    report = await Ctl(ctx).migrate(sid, other, 90)
                    assert report["ok"] and report["dst"] == other
                    moved_at = max(len(v.chunks) for v in viewers)
                    rtc_at = len(rtc_sizes)
                    await eventually(
                        lambda: each_has(moved_at + 2), 120, "chunks after the migration"
                    )
                    await eventually(
                        lambda: len(rtc_sizes) >= rtc_at + 12, 60, "WebRTC frames after it"
                    )
                finally:
                    for reader in readers:
                        reader.cancel()
                    await asyncio.gather(*readers, return_exceptions=True)
            await http.delete(f"/v1/sessions/{sid}", headers=auth)
    finally:
        with contextlib.suppress(Exception):
            await rtc.close()
        mesh.stop()

    for viewer in (jpeg, fmp4, socket):
        assert viewer.seqs == list(range(len(viewer.seqs))), (viewer.name, viewer.seqs)
        assert all(size == NATIVE for _, size in viewer.chunks), viewer.name
        assert "prompt" in viewer.notices and "migrated" in viewer.notices, viewer.notices
        assert "unpublished" not in viewer.notices, viewer.name
    assert rtc_sizes and set(rtc_sizes) == {NATIVE}
    notices = []
    while not rtc.messages.empty():
        notices.append(rtc.messages.get_nowait())
    assert "migrated" in {m.get("kind") for m in notices if m["type"] == "state"}
    text = _logs(logs)
    assert "not_published" not in text and "chunk_unpublished" not in text

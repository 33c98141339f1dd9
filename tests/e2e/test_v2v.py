"""A video-to-video session end to end through the mesh as `turboserve up` runs it with a tiny
Wan2.1 folder: a WebSocket client sends camera frames (JPEG, in binary messages) and reads the
restyled chunks back, while its session is migrated to the other worker and that worker is then
killed. Its chunks stay consecutive, each made from the input chunk of the same index, and the
session's input follows it to each new owner."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import struct
import time

import aiohttp
import numpy as np
import orjson
import pytest
from PIL import Image

from shared.wire import WorkerStatus
from tests.e2e.test_real_model import _logs, _worker_pid
from tests.eventually import eventually
from tests.gpu_worker.worker_harness import mesh_context
from tests.models import RESOLUTION, build_folder
from tools.ctl import Ctl
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HEADER = struct.Struct(">I")
FPS = 16.0


def jpegs(count: int = 16) -> list[bytes]:
    out = []
    ys, xs = np.mgrid[0:120, 0:160].astype(np.float32)
    for t in range(count):
        image = np.stack(
            [
                128 + 100 * np.sin((xs + 5 * t) / 13),
                128 + 90 * np.cos(ys / 11),
                xs * 0 + 40 * t % 256,
            ],
            axis=-1,
        )
        buf = io.BytesIO()
        Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG")
        out.append(buf.getvalue())
    return out


class Camera:
    """A WebSocket client of a video session: sends frames at FPS, reads chunks and notices."""

    def __init__(self) -> None:
        self.sent = 0
        self.chunks: list[dict] = []
        self.notices: list[str] = []
        self.errors: list[dict] = []

    async def send(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        frames = jpegs()
        start = time.monotonic()
        while True:
            header = orjson.dumps({"type": "frame", "seq": self.sent, "captured_at": time.time()})
            await ws.send_bytes(HEADER.pack(len(header)) + header + frames[self.sent % 16])
            self.sent += 1
            await asyncio.sleep(max(0.0, start + self.sent / FPS - time.monotonic()))

    async def read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.BINARY:
                (size,) = HEADER.unpack_from(msg.data)
                head = orjson.loads(msg.data[HEADER.size : HEADER.size + size])
                self.chunks.append(
                    {
                        "seq": head["seq"],
                        "frames": round(head["duration_s"] * head["fps"]),
                        "size": (head["height"], head["width"]),
                        "input_seq": head["timing"]["input_seq"],
                        "worker": head["worker_id"],
                    }
                )
            elif msg.type is aiohttp.WSMsgType.TEXT:
                body = orjson.loads(msg.data)
                if body["type"] == "state":
                    self.notices.append(body["kind"])
                elif body["type"] == "error":
                    self.errors.append(body)
            else:
                return


def _mesh(infra, isolation, tmp_path) -> Mesh:
    folder = build_folder(tmp_path / "wan", "diffusers")
    env = {
        **isolation,
        "TURBOSERVE_LOG_LEVEL": "warning",
        "TURBOSERVE_MODEL": str(folder),
        "TURBOSERVE_RESOLUTION": f"{RESOLUTION[0]}x{RESOLUTION[1]}",
        "TURBOSERVE_MAX_WORKERS": "2",
    }
    (tmp_path / "logs").mkdir()
    return Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=2,
        embedded="never",
        env=env,
        quiet=True,
        log_dir=tmp_path / "logs",
    )


async def _two_ready(ctx, logs) -> None:
    async def ready() -> bool:
        up = [w for w in await ctx.registry.workers() if w.alive and w.status is WorkerStatus.READY]
        assert len(up) >= 2, _logs(logs)
        return True

    await eventually(ready, 180, "two workers ready", interval=0.5)


async def _migrate_then_kill(ctx, mesh: Mesh, sid: str, camera: Camera) -> None:
    """Three chunks, a migration to the other worker, three more, that worker killed, three
    more."""
    await eventually(lambda: len(camera.chunks) >= 3, 120, "first chunks")
    owner = (await ctx.registry.get_session(sid)).owner
    others = [w.id for w in await ctx.registry.workers() if w.alive and w.id != owner]
    report = await Ctl(ctx).migrate(sid, others[0], 60)
    assert report["ok"] and report["dst"] == others[0]
    moved_at = len(camera.chunks)
    await eventually(lambda: len(camera.chunks) >= moved_at + 3, 60, "chunks after the migration")
    os.kill(_worker_pid(mesh, others[0]), signal.SIGKILL)
    killed_at = len(camera.chunks)
    await eventually(
        lambda: len(camera.chunks) >= killed_at + 3, 120, "chunks after the worker was killed"
    )


def _check(camera: Camera) -> None:
    seqs = [c["seq"] for c in camera.chunks]
    assert seqs == list(range(len(seqs))), seqs  # nothing lost or repeated across the events
    assert not camera.errors, camera.errors
    assert all(c["size"] == RESOLUTION for c in camera.chunks)
    # The Wan VAE: 9 frames for the first input and output chunk, then 12.
    assert [c["frames"] for c in camera.chunks[:3]] == [9, 12, 12]
    # Each chunk was made from a later input chunk than the one before it (frames a handoff
    # finds in flight are dropped: the next chunk takes the next frames).
    inputs = [c["input_seq"] for c in camera.chunks]
    frames = [c["frames"] for c in camera.chunks]
    assert inputs[0] >= frames[0] - 1, inputs
    assert all(b >= a + f for a, b, f in zip(inputs, inputs[1:], frames[1:], strict=False)), inputs
    assert len({c["worker"] for c in camera.chunks}) >= 2  # the first owner and the migration's
    assert "migrated" in camera.notices and "recovered" in camera.notices, camera.notices


async def test_a_camera_session_streams_across_a_migration_and_a_killed_worker(
    infra, isolation, tmp_path
):
    mesh = _mesh(infra, isolation, tmp_path)
    mesh.start(ready_timeout=180)
    conn = {"TURBOSERVE_NATS_URL": infra.nats_url, "TURBOSERVE_REDIS_URL": infra.redis_url}
    camera = Camera()
    try:
        async with (
            mesh_context({**conn, **isolation}) as (ctx, _),
            aiohttp.ClientSession(mesh.gateway_url) as http,
        ):
            await _two_ready(ctx, tmp_path / "logs")
            resp = await http.post(
                "/v1/sessions",
                json={"prompt": "as an oil painting", "seed": 5, "input": "video"},
            )
            assert resp.status == 201, await resp.text()
            session = await resp.json()
            assert (session["input"], session["strength"]) == ("video", 0.7)
            sid, auth = session["id"], {"Authorization": f"Bearer {session['token']}"}
            async with http.ws_connect(
                f"/v1/sessions/{sid}/ws", params={"format": "fmp4", "from": "start"}, headers=auth
            ) as ws:
                tasks = [
                    asyncio.ensure_future(camera.read(ws)),
                    asyncio.ensure_future(camera.send(ws)),
                ]
                try:
                    await _migrate_then_kill(ctx, mesh, sid, camera)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
            await http.delete(f"/v1/sessions/{sid}", headers=auth)
    finally:
        mesh.stop()
    _check(camera)


# Chromium's fake camera (a moving test pattern, 640x480), granted without a prompt; host
# addresses without mDNS names (aioice resolves them per event loop: see test_webrtc_browser).
FAKE_CAMERA = (
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
)


async def test_the_playground_camera_mode_streams_across_a_migration_and_a_killed_worker(
    infra, isolation, tmp_path
):
    """The playground in camera mode in headless Chromium: its fake camera goes to the gateway
    over WebRTC and the restyled video comes back on the same peer connection, while a
    WebSocket viewer of the same session reads the chunks with their input seqs."""
    from selenium.webdriver.common.by import By

    from tests.gateway.test_browser import chromium

    with chromium(*FAKE_CAMERA) as browser:
        browser.set_page_load_timeout(60)
        mesh = _mesh(infra, isolation, tmp_path)
        mesh.start(ready_timeout=180)
        conn = {"TURBOSERVE_NATS_URL": infra.nats_url, "TURBOSERVE_REDIS_URL": infra.redis_url}
        viewer = Camera()
        try:
            async with (
                mesh_context({**conn, **isolation}) as (ctx, _),
                aiohttp.ClientSession(mesh.gateway_url) as http,
            ):
                await _two_ready(ctx, tmp_path / "logs")
                browser.get(mesh.gateway_url + "/#input=camera")
                browser.find_element(By.ID, "start").click()

                def started() -> dict | None:
                    return browser.execute_script("return window.turboserveSession || null")

                await eventually(started, 30, "the playground's session")
                session = started()
                assert session is not None
                sid, auth = session["id"], {"Authorization": f"Bearer {session['token']}"}
                async with http.ws_connect(
                    f"/v1/sessions/{sid}/ws",
                    params={"format": "fmp4", "from": "start"},
                    headers=auth,
                ) as ws:
                    reading = asyncio.ensure_future(viewer.read(ws))
                    try:
                        await _migrate_then_kill(ctx, mesh, sid, viewer)
                    finally:
                        reading.cancel()
                        await asyncio.gather(reading, return_exceptions=True)
                stats = browser.execute_script("return window.turboserveCamera")
                log = browser.find_element(By.ID, "log").text
                await http.delete(f"/v1/sessions/{sid}", headers=auth)
        finally:
            mesh.stop()
    assert stats["camera"] is True, log  # the gateway took the camera
    assert stats["framesSent"] > 30 and stats["framesDecoded"] > 9, (stats, log)
    _check(viewer)

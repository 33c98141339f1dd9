"""The playground and the dashboard in headless Chromium (Debian's chromium and chromedriver,
through selenium; nothing is downloaded), against the real mesh.

The playground plays ``?format=fmp4`` in a ``<video>`` through Media Source Extensions by
default (Debian's chromium plays the worker's H.264), and ``#format=jpeg`` draws JPEG frames on
a canvas; both are played here.

Skipped with the reason when chromium is missing, unless TURBOSERVE_REQUIRE_BROWSER=1 (then
missing chromium fails). With TURBOSERVE_SCREENSHOT_DIR set, the pages are saved there as
playground.png and dashboard.png (the README's pictures come from this test).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.settings import SuiteSettings
from tests.eventually import eventually_sync
from tests.gateway.conftest import API_KEY, OPERATOR_KEY
from tools.launcher import Mesh
from tools.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1000",
)


def _browser_or_skip():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install '.[test]')")
    if missing:
        reason = f"no browser to drive: {', '.join(missing)} missing (apt install chromium chromium-driver)"
        if SuiteSettings.from_env().require_browser:
            pytest.fail(reason + "; TURBOSERVE_REQUIRE_BROWSER=1 asks for it")
        pytest.skip(reason)


@contextlib.contextmanager
def chromium(*flags: str) -> Iterator[Any]:
    """Headless Debian Chromium through chromedriver, in a fresh profile, with ``flags`` added
    (skipped where there is none, failed under TURBOSERVE_REQUIRE_BROWSER=1)."""
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="turboserve-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROME_FLAGS, *flags, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    d = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield d
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def driver() -> Iterator[object]:
    with chromium() as d:
        d.set_page_load_timeout(60)
        yield d


@pytest.fixture(scope="module")
def mesh(infra, driver) -> Iterator[Mesh]:  # driver first: no mesh is started to be skipped
    tag = "t" + uuid.uuid4().hex[:10]
    m = Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=1,
        embedded="never",
        quiet=True,
        env={
            "TURBOSERVE_SUBJECT_PREFIX": tag,
            "TURBOSERVE_REDIS_NAMESPACE": tag,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_CHUNK_PERIOD_S": "0.75",
            "TURBOSERVE_API_KEYS": f"web:{API_KEY}",
            "TURBOSERVE_OPERATOR_KEY": OPERATOR_KEY,
            "TURBOSERVE_MAX_WORKERS": "1",
            "TURBOSERVE_CONTROL_WAIT_S": "20",
        },
    )
    m.start(ready_timeout=180)
    yield m
    m.stop()
    import asyncio

    from tests.gateway.test_mesh_e2e import _clean

    asyncio.run(_clean(infra, tag))


def log_lines(d) -> list[str]:
    return [li.text for li in d.find_elements("css selector", "#log li")]


def canvas_has_a_picture(d) -> bool:
    """The canvas holds an image: its pixels differ (an empty canvas is uniform)."""
    return d.execute_script("""
        const c = document.getElementById('screen');
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let lo = 255, hi = 0;
        for (let i = 0; i < px.length; i += 4) { lo = Math.min(lo, px[i + 1]); hi = Math.max(hi, px[i + 1]); }
        return px[3] > 0 && hi - lo > 8;
    """)


def video_has_a_picture(d) -> bool:
    """The <video> shows a decoded picture: its current frame, drawn on a scratch canvas, is
    not uniform."""
    return d.execute_script("""
        const v = document.getElementById('video');
        if (v.hidden || v.readyState < 2 || !v.videoWidth) return false;
        const c = document.createElement('canvas');
        c.width = v.videoWidth; c.height = v.videoHeight;
        const ctx = c.getContext('2d');
        ctx.drawImage(v, 0, 0);
        const px = ctx.getImageData(0, 0, c.width, c.height).data;
        let lo = 255, hi = 0;
        for (let i = 0; i < px.length; i += 4) { lo = Math.min(lo, px[i + 1]); hi = Math.max(hi, px[i + 1]); }
        return hi - lo > 8;
    """)


def video_time(d) -> float:
    return d.execute_script("return document.getElementById('video').currentTime")


def open_playground(d, gateway_url: str, hash_args: str = "") -> None:
    d.get("about:blank")  # a new document even where only the address's hash differs
    d.get(f"{gateway_url}/#key={API_KEY}{hash_args}")


def screenshot(d, name: str, settle_s: float = 0.0) -> None:
    folder = SuiteSettings.from_env().screenshot_dir
    if folder:
        time.sleep(settle_s)  # let the charts gather some history for the picture
        d.execute_script("window.scrollTo(0, 0)")
        Path(folder).mkdir(parents=True, exist_ok=True)
        d.save_screenshot(str(Path(folder) / name))


def test_playground_plays_and_steers_and_the_dashboard_lists_the_session(driver, mesh):
    d = driver
    open_playground(d, mesh.gateway_url)
    assert d.find_element("id", "format").get_attribute("value") == "fmp4"  # the default
    prompt = d.find_element("id", "prompt")
    prompt.clear()
    prompt.send_keys("a red fox running through fresh snow")
    d.find_element("id", "start").click()
    # textContent, not .text: the heading is shown in upper case
    session_id = eventually_sync(
        lambda: d.find_element("id", "session-id").get_attribute("textContent"),
        timeout=90,
        what="a session id",
    )
    assert not d.find_element("id", "start-error").text

    # the video plays the stream's fragments
    eventually_sync(
        lambda: int(d.find_element("id", "frames-drawn").text) >= 12,
        timeout=90,
        what="frames shown",
    )
    eventually_sync(lambda: video_has_a_picture(d), timeout=10, what="a picture in the video")
    assert not d.find_element("id", "screen").is_displayed()
    assert float(d.find_element("id", "latency").text) >= 0  # per-chunk latency shown
    assert any("placed" in line for line in log_lines(d))

    # change the prompt while it plays
    box = d.find_element("id", "new-prompt")
    box.send_keys("a wolf howling at the moon")
    d.find_element("id", "send-prompt").click()
    ack = eventually_sync(
        lambda: [x for x in log_lines(d) if x.startswith("prompt")], timeout=90, what="prompt ack"
    )
    assert "from seq" in ack[0], ack
    before = int(d.find_element("id", "frames-drawn").text)
    eventually_sync(
        lambda: int(d.find_element("id", "frames-drawn").text) > before + 12,
        timeout=90,
        what="more frames",
    )
    screenshot(d, "playground.png", settle_s=5)

    # the dashboard, in a second tab, lists the session on its worker
    playground = d.current_window_handle
    d.switch_to.new_window("tab")
    d.get(f"{mesh.gateway_url}/dashboard#key={OPERATOR_KEY}")

    def session_listed() -> list[Any]:
        listed = d.find_elements("css selector", f'[data-session="{session_id}"]')
        assert listed, (
            f"error shown: {d.find_element('id', 'error').text!r}; "
            f"workers: {d.find_element('id', 'workers').text!r}"
        )
        return listed

    eventually_sync(session_listed, timeout=90, what="the session on the dashboard")
    card = d.find_element("css selector", ".card[data-worker]")
    assert "ready" in card.text and "load" in card.text
    assert d.find_element("id", "n-sessions").text == "1"
    assert not d.find_element("id", "error").text
    eventually_sync(
        lambda: d.execute_script(
            "return document.getElementById('latency-chart').getContext('2d')"
            ".getImageData(0, 0, 1200, 160).data.some((v, i) => i % 4 === 3 && v > 0)"
        ),
        timeout=90,
        what="the latency chart drawn",
    )
    screenshot(d, "dashboard.png", settle_s=20)

    # back to the playground: pause, resume, close
    d.switch_to.window(playground)
    d.find_element("id", "pause").click()
    eventually_sync(
        lambda: [x for x in log_lines(d) if x.startswith("pause")], timeout=90, what="pause ack"
    )
    # no chunks while suspended: the video runs dry and waits for its buffer again
    eventually_sync(
        lambda: d.execute_script("return window.turboserveVideo.rebuffers") >= 1,
        timeout=15,
        what="the video run dry while paused",
    )
    d.find_element("id", "resume").click()
    eventually_sync(
        lambda: [x for x in log_lines(d) if x.startswith("resume")], timeout=90, what="resume ack"
    )
    resumed_at = video_time(d)
    eventually_sync(lambda: video_time(d) > resumed_at + 1, timeout=20, what="the video playing on")
    d.find_element("id", "close").click()
    eventually_sync(
        lambda: d.find_element("id", "state").text == "closed", timeout=90, what="closed"
    )
    (closed,) = eventually_sync(
        lambda: [x for x in log_lines(d) if x.startswith("close")], timeout=90, what="close ack"
    )
    assert closed.startswith("close closed after seq ") and "not confirmed" not in closed, closed

    # the dashboard drops it
    d.switch_to.window(d.window_handles[-1])
    eventually_sync(
        lambda: not d.find_elements("css selector", f'[data-session="{session_id}"]'),
        timeout=90,
        what="the session gone from the dashboard",
    )


def test_dashboard_without_the_operator_key_says_so(driver, mesh):
    d = driver
    d.get(f"{mesh.gateway_url}/dashboard")
    d.execute_script("localStorage.clear()")
    d.get("about:blank")  # a new document: the page reads its key again
    d.get(f"{mesh.gateway_url}/dashboard#key=wrong")
    error = eventually_sync(
        lambda: d.find_element("id", "error").text, timeout=90, what="an error shown"
    )
    assert "unauthorized" in error


def test_the_video_goes_on_after_the_socket_drops(driver, mesh):
    """A dropped WebSocket reconnects with last_event_id, and the video plays on from where its
    timeline was: the fragments that came meanwhile are appended after the ones it has."""
    d = driver
    open_playground(d, mesh.gateway_url)
    d.find_element("id", "start").click()
    eventually_sync(
        lambda: video_time(d) > 0 and video_has_a_picture(d), timeout=60, what="the video playing"
    )
    appended = d.execute_script("return window.turboserveVideo.appended")
    d.execute_script("socket.close()")  # the page's own socket (a top-level binding)
    eventually_sync(
        lambda: [x for x in log_lines(d) if x.startswith("socket")],
        timeout=5,
        what="the drop noticed",
    )
    dropped_at = video_time(d)
    eventually_sync(
        lambda: d.execute_script("return window.turboserveVideo.appended") > appended + 3,
        timeout=20,
        what="fragments after the reconnect",
    )
    eventually_sync(lambda: video_time(d) > dropped_at + 2, timeout=10, what="the video playing on")
    samples = d.execute_script("return window.turboserveVideo.samples")
    around = [s for s in samples if s[1] >= dropped_at - 1]
    figures = video_playback(around, (around[-1][0] - around[0][0]) / 1000)
    print(
        f"\nacross the drop: longest stall {figures['stall_s']:.2f} s, "
        f"{figures['seeks']} seeks, {figures['advance_s']:.2f} s advanced"
    )
    assert not [x for x in log_lines(d) if x.startswith("format")]  # no fallback to JPEG
    d.find_element("id", "close").click()
    eventually_sync(
        lambda: d.find_element("id", "state").text == "closed", timeout=90, what="closed"
    )


def test_the_playground_falls_back_to_jpeg_where_the_codec_cannot_play(driver, mesh):
    """A browser whose MediaSource refuses the fragments' codec: the page says so and draws the
    same session's JPEG frames on the canvas."""
    d = driver
    script = d.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument",
        {"source": "MediaSource.isTypeSupported = () => false;"},
    )
    try:
        open_playground(d, mesh.gateway_url)
        d.find_element("id", "start").click()
        eventually_sync(
            lambda: int(d.find_element("id", "frames-drawn").text) >= 12,
            timeout=60,
            what="frames drawn",
        )
        (fallback,) = [x for x in log_lines(d) if x.startswith("format")]
        assert "video/mp4" in fallback and "JPEG frames" in fallback, fallback
        assert canvas_has_a_picture(d) and not d.find_element("id", "video").is_displayed()
        assert d.execute_script("return window.turboserveVideo.appended") == 0
        d.find_element("id", "close").click()
        eventually_sync(
            lambda: d.find_element("id", "state").text == "closed", timeout=90, what="closed"
        )
    finally:
        d.execute_cdp_cmd(
            "Page.removeScriptToEvaluateOnNewDocument", {"identifier": script["identifier"]}
        )


@pytest.fixture(scope="module")
def emulated_mesh(infra, driver) -> Iterator[Mesh]:
    """The mesh as ``turboserve up`` runs it on a machine without a GPU: a CPU worker emulating
    an H20, whose chunk period (1.25 s, the profile's deadline) is longer than 12 frames at
    16 fps."""
    tag = "t" + uuid.uuid4().hex[:10]
    m = Mesh(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        port=free_port(),
        workers=1,
        embedded="never",
        quiet=True,
        env={
            "TURBOSERVE_SUBJECT_PREFIX": tag,
            "TURBOSERVE_REDIS_NAMESPACE": tag,
            "TURBOSERVE_LOG_LEVEL": "warning",
            "TURBOSERVE_EMULATE": "H20",
            "TURBOSERVE_API_KEYS": f"web:{API_KEY}",
            "TURBOSERVE_MAX_WORKERS": "1",
        },
    )
    m.start(ready_timeout=180)
    yield m
    m.stop()
    import asyncio

    from tests.gateway.test_mesh_e2e import _clean

    asyncio.run(_clean(infra, tag))


PLAY_S = 30.0


def test_the_playground_draws_without_a_freeze_at_the_emulated_period(driver, emulated_mesh):
    """30 s of a playing session: after the first second, no gap between drawn frames longer
    than twice the nominal frame interval (each chunk's frames at its own fps, which the
    worker makes frames / period)."""
    d = driver
    open_playground(d, emulated_mesh.gateway_url, "&format=jpeg")
    assert d.find_element("id", "format").get_attribute("value") == "jpeg"
    d.find_element("id", "start").click()
    eventually_sync(
        lambda: int(d.find_element("id", "frames-drawn").text) >= 1,
        timeout=120,
        what="a first frame drawn",
    )
    assert canvas_has_a_picture(d) and not d.find_element("id", "video").is_displayed()
    first = d.execute_script("return window.turboservePlayback.times[0]")
    eventually_sync(
        lambda: d.execute_script("return performance.now()") - first >= PLAY_S * 1000,
        timeout=PLAY_S + 30,
        what=f"{PLAY_S:.0f} s of playback",
    )
    stats = d.execute_script("return window.turboservePlayback")
    times, intervals = stats["times"], stats["intervals"]
    kept = [
        (b - a, nominal)
        for a, b, nominal in zip(times, times[1:], intervals, strict=False)
        if a - times[0] >= 1000 and b - times[0] <= PLAY_S * 1000
    ]
    gaps = sorted(gap for gap, _ in kept)
    worst = max(kept, key=lambda g: g[0] / g[1])
    freezes = [g for g, nominal in kept if g > 2 * nominal]
    print(
        f"\nplayback over {PLAY_S:.0f} s after the first second: {len(kept)} frame intervals, "
        f"nominal {min(n for _, n in kept):.0f}-{max(n for _, n in kept):.0f} ms, "
        f"gaps min {gaps[0]:.0f} / median {gaps[len(gaps) // 2]:.0f} / max {gaps[-1]:.0f} ms, "
        f"{len(freezes)} longer than twice the nominal interval"
    )
    assert len(kept) > PLAY_S * 7  # about 9.6 frames a second were drawn
    assert not freezes, f"worst gap {worst[0]:.0f} ms against a nominal {worst[1]:.0f} ms"


VIDEO_PLAY_S = 20.0
EMULATED_PERIOD_S = 1.25  # the H20's deadline: the emulated worker's chunk period


def video_playback(samples: list[list[float]], play_s: float) -> dict[str, float]:
    """From the page's (performance.now() ms, currentTime s) samples: when currentTime first
    advanced, then over the next ``play_s`` seconds the longest time it stood still (``stall_s``)
    and how far it advanced by playing (``advance_s``; a jump of more than half a second is a
    seek, not playing)."""
    moved = [i for i in range(1, len(samples)) if 0 < samples[i][1] - samples[i - 1][1] < 0.5]
    assert moved, "currentTime never advanced: no fragment was played"
    start_ms = samples[moved[0] - 1][0]
    window = [s for s in samples[moved[0] - 1 :] if s[0] <= start_ms + play_s * 1000]
    last_move_ms, stall_ms, advance, seeks = window[0][0], 0.0, 0.0, 0
    for (_, t0), (ms, t1) in zip(window, window[1:], strict=False):
        step = t1 - t0
        if 0 < step < 0.5:
            advance += step
            stall_ms = max(stall_ms, ms - last_move_ms)
            last_move_ms = ms
        elif step != 0:
            seeks += 1
            last_move_ms = ms
    stall_ms = max(stall_ms, window[-1][0] - last_move_ms)
    return {
        "stall_s": stall_ms / 1000,
        "advance_s": advance,
        "seeks": seeks,
        "span_s": (window[-1][0] - start_ms) / 1000,
        "start_ms": start_ms,
    }


def test_the_playground_plays_the_video_steadily_at_the_emulated_period(driver, emulated_mesh):
    """The default stream (fMP4 through Media Source Extensions) for 20 s after the video
    starts, with a prompt change on the way: currentTime advances with the clock, and never
    stands still for longer than one chunk period."""
    d = driver
    open_playground(d, emulated_mesh.gateway_url)
    d.find_element("id", "start").click()
    eventually_sync(
        lambda: d.execute_script(
            "const s = window.turboserveVideo.samples;"
            "return s.length > 1 && s[s.length - 1][1] > s[0][1]"
        ),
        timeout=120,
        what="the video playing",
    )
    began = time.monotonic()
    eventually_sync(
        lambda: time.monotonic() - began >= VIDEO_PLAY_S * 0.4,
        timeout=VIDEO_PLAY_S,
        what="the first part of the playback",
    )
    box = d.find_element("id", "new-prompt")
    box.send_keys("a storm over a dark sea")
    d.find_element("id", "send-prompt").click()
    eventually_sync(
        lambda: [x for x in log_lines(d) if x.startswith("prompt")], timeout=90, what="prompt ack"
    )
    eventually_sync(
        lambda: time.monotonic() - began >= VIDEO_PLAY_S + 1,
        timeout=VIDEO_PLAY_S + 5,
        what=f"{VIDEO_PLAY_S:.0f} s of playback",
    )
    stats = d.execute_script("return window.turboserveVideo")
    figures = video_playback(stats["samples"], VIDEO_PLAY_S)
    page_seeks = [s for s in stats["seeks"] if s[0] > figures["start_ms"]]
    print(
        f"\nvideo over {figures['span_s']:.1f} s after it started: currentTime advanced "
        f"{figures['advance_s']:.2f} s, longest stall {figures['stall_s']:.2f} s "
        f"(bar {EMULATED_PERIOD_S} s), {stats['appended']} fragments appended, "
        f"{len(page_seeks)} seeks by the page after the start, "
        f"{stats['rebuffers']} waits for the buffer after running dry"
    )
    assert figures["span_s"] >= VIDEO_PLAY_S - 0.5
    assert figures["stall_s"] <= EMULATED_PERIOD_S, figures
    # Steady: as much video as wall time, less at most one chunk period of stalls in all.
    assert VIDEO_PLAY_S - EMULATED_PERIOD_S <= figures["advance_s"] <= VIDEO_PLAY_S + 0.5, figures
    assert stats["appended"] >= VIDEO_PLAY_S / EMULATED_PERIOD_S
    assert video_has_a_picture(d) and not d.find_element("id", "control-error").text
    assert not [x for x in log_lines(d) if x.startswith("format")]  # no fallback to JPEG

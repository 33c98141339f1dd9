"""WebRTC in the browser the tests drive (Debian's headless Chromium): the page offers, posts
the offer with the session token, plays the video track, changes the prompt over the data
channel and gets its ack; Chromium's own statistics say how many frames it decoded, in which
codec. Skipped, with the reason, where there is no Chromium (as ``test_browser.py``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import orjson
import pytest

from shared.wire import NoticeKind
from tests.eventually import eventually
from tests.gateway.conftest import create
from tests.gateway.test_browser import chromium
from tests.gateway.test_fmp4_stream import HEIGHT, PERIOD_S, WIDTH, _claimed, _viewers, publish

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Chromium hides its host addresses behind mDNS names; aioice would resolve them through one
# mDNS responder per thread, bound to the event loop that first asked (each test has its own).
NO_MDNS = "--disable-features=WebRtcHideLocalIpsWithMdns"


@pytest.fixture(scope="module")
def driver() -> Iterator[object]:
    with chromium(NO_MDNS) as d:
        d.set_script_timeout(60)
        yield d


PAGE = """
const [url, token, only, done] = arguments;
(async () => {
  const out = {};
  const pc = new RTCPeerConnection({iceServers: []});
  const video_in = pc.addTransceiver('video', {direction: 'recvonly'});
  if (only) {  // offer this codec only (and its retransmissions)
    video_in.setCodecPreferences(RTCRtpReceiver.getCapabilities('video').codecs
      .filter((c) => c.mimeType === only || c.mimeType === 'video/rtx'));
  }
  const channel = pc.createDataChannel('control');
  const video = document.createElement('video');
  video.muted = true; video.autoplay = true; video.playsInline = true;
  document.body.appendChild(video);
  pc.ontrack = (event) => { video.srcObject = new MediaStream([event.track]); };
  channel.onopen = () => channel.send(JSON.stringify({type: 'prompt', prompt: 'a storm', id: 'b1'}));
  channel.onmessage = (event) => {
    const message = JSON.parse(event.data);
    if (message.type === 'ack' || message.type === 'error') out.reply = message;
  };
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((resolve) => {  // the whole offer at once: no trickle
    if (pc.iceGatheringState === 'complete') resolve();
    pc.addEventListener('icegatheringstatechange', () => {
      if (pc.iceGatheringState === 'complete') resolve();
    });
    setTimeout(resolve, 5000);
  });
  out.offeredH264 = pc.localDescription.sdp.includes('H264/90000');
  const resp = await fetch(url, {method: 'POST', body: JSON.stringify({type: 'offer', sdp: pc.localDescription.sdp}),
                                 headers: {'Authorization': 'Bearer ' + token, 'Content-Type': 'application/json'}});
  const answer = await resp.json();
  out.status = resp.status;
  out.video = answer.video;
  if (resp.status !== 200) { out.body = answer; done(out); return; }
  await pc.setRemoteDescription({type: 'answer', sdp: answer.sdp});
  const deadline = Date.now() + 40000;
  while (Date.now() < deadline) {
    const stats = await pc.getStats();
    stats.forEach((s) => {
      if (s.type === 'inbound-rtp' && s.kind === 'video') {
        out.framesDecoded = s.framesDecoded || 0;
        const codec = s.codecId && stats.get(s.codecId);
        out.codec = codec ? codec.mimeType : null;
      }
    });
    if (out.framesDecoded >= 9 && out.reply && video.videoWidth) break;
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
  out.size = [video.videoWidth, video.videoHeight];
  out.connection = pc.connectionState;
  pc.close();
  done(out);
})().catch((error) => done({error: String(error)}));
"""


def _play(browser, page: str, url: str, token: str, only: str | None) -> dict:
    browser.get(page)  # the gateway's origin: the POST is same-origin for the page
    return browser.execute_async_script(PAGE, url, token, only)


@pytest.mark.parametrize("only", [None, "video/VP8"])  # H.264 passed through; VP8 re-encoded
async def test_chromium_plays_the_session_over_webrtc_and_steers_on_the_data_channel(
    driver, http, gw, worker, nats_client, only
):
    s = await create(http)
    sid = s["id"]
    registry = await _claimed(gw, sid, worker)
    events = await nats_client.subscribe(gw.ctx.subjects.session_events)

    # Stopped by this flag as well as cancelled: a cancel that lands as next_msg's own timeout
    # fires can come out as a TimeoutError (suppressed below), and the loop would run on.
    stopping = asyncio.Event()

    async def worker_runs() -> None:  # a chunk a period, and the prompt notice when asked
        seq = 0
        while not stopping.is_set():
            await publish(worker, sid, seq, registry=registry)
            seq += 1
            with contextlib.suppress(TimeoutError):
                msg = await events.next_msg(timeout=PERIOD_S)
                if orjson.loads(msg.data)["kind"] == "prompt":
                    await worker.notice(sid, NoticeKind.PROMPT, seq + 1)

    running = asyncio.create_task(worker_runs())
    try:
        # The browser blocks its thread, not the loop this gateway runs on.
        result = await asyncio.wait_for(
            asyncio.to_thread(
                _play, driver, f"{gw.url}/healthz", f"/v1/sessions/{sid}/webrtc", s["token"], only
            ),
            90,
        )
    finally:
        stopping.set()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert result.get("error") is None and result["status"] == 200, result
    expected = "video/H264" if result["offeredH264"] else "video/VP8"
    assert (only is None) == result["offeredH264"]  # Debian's Chromium offers H.264
    assert result["video"] == {"codec": expected, "pass_through": expected == "video/H264"}, result
    assert result["codec"] and result["codec"].lower() == expected.lower(), result
    assert result["framesDecoded"] >= 9 and result["size"] == [WIDTH, HEIGHT], result
    assert result["reply"] == {
        **result["reply"],
        "type": "ack",
        "control": "prompt",
        "id": "b1",
        "confirmed": True,
    }, result
    await eventually(lambda: _viewers_gone(gw, sid), timeout=40)


async def _viewers_gone(gw, sid: str) -> bool:
    return not await _viewers(gw, sid, 1)

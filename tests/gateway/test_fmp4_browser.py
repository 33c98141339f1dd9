"""The codec choice, checked in the browser the tests drive (Debian's headless Chromium): it
takes the stream's MIME type for Media Source Extensions, and the fMP4 fragments a viewer gets
over SSE, joining mid-stream, append into one buffered range and decode to the right size.
Skipped, with the reason, where there is no Chromium (as ``test_browser.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.eventually import eventually
from tests.gateway.conftest import create
from tests.gateway.test_browser import chromium
from tests.gateway.test_fmp4_stream import HEIGHT, PERIOD_S, WIDTH, _claimed, _viewers, publish

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# In the page: an EventSource on the fMP4 stream; the first three chunks' fragments are
# appended to one SourceBuffer as they come; then what the browser buffered and decoded.
PLAYER = """
const [url, done] = arguments;
const out = {seqs: [], mimes: []};
const video = document.createElement('video');
video.muted = true;
document.body.appendChild(video);
const media = new MediaSource();
video.src = URL.createObjectURL(media);
media.addEventListener('sourceopen', () => {
  let buffer = null, chain = Promise.resolve();
  const source = new EventSource(url);
  source.addEventListener('chunk', (event) => {
    const chunk = JSON.parse(event.data);
    if (out.seqs.length >= 3) return;
    out.seqs.push(chunk.seq);
    out.mimes.push(chunk.mime);
    if (buffer === null) {
      out.supported = MediaSource.isTypeSupported(chunk.mime);
      buffer = media.addSourceBuffer(chunk.mime);
    }
    const bytes = Uint8Array.from(atob(chunk.fragment), (c) => c.charCodeAt(0));
    chain = chain.then(() => new Promise((resolve, reject) => {
      buffer.addEventListener('updateend', resolve, {once: true});
      buffer.addEventListener('error', () => reject(new Error('append failed')), {once: true});
      buffer.appendBuffer(bytes);
    }));
    if (out.seqs.length === 3) {
      source.close();
      chain.then(async () => {
        out.ranges = [];
        for (let i = 0; i < buffer.buffered.length; i++) {
          out.ranges.push([buffer.buffered.start(i), buffer.buffered.end(i)]);
        }
        video.currentTime = out.ranges[0][0] + 0.1;
        await new Promise((resolve) => {
          if (video.readyState >= 2) resolve();
          video.addEventListener('loadeddata', resolve, {once: true});
          setTimeout(resolve, 5000);
        });
        out.readyState = video.readyState;
        out.size = [video.videoWidth, video.videoHeight];
        out.error = video.error && video.error.message;
        done(out);
      }, (e) => { out.error = String(e); done(out); });
    }
  });
});
"""


@pytest.fixture(scope="module")
def driver() -> Iterator[object]:
    with chromium() as d:
        d.set_script_timeout(60)
        yield d


def _play(driver, page: str, url: str) -> dict:
    driver.get(page)  # the gateway's origin: the stream is same-origin for the page
    return driver.execute_async_script(PLAYER, url)


async def test_chromium_plays_the_fmp4_stream_joined_mid_stream(driver, http, gw, worker):
    s = await create(http)
    sid = s["id"]
    registry = await _claimed(gw, sid, worker)
    for seq in range(2):
        await publish(worker, sid, seq, registry=registry)
    await worker.nc.flush()
    url = f"{s['stream_url']}?format=fmp4&token={s['token']}"
    # The browser blocks its thread, not the loop this gateway runs on.
    playing = asyncio.create_task(asyncio.to_thread(_play, driver, f"{gw.url}/healthz", url))
    await eventually(lambda: _viewers(gw, sid, 1), timeout=30)
    for seq in (2, 3):
        await publish(worker, sid, seq, registry=registry)
    result = await asyncio.wait_for(playing, 90)
    assert result.get("error") is None, result
    assert result["supported"] and result["mimes"][0].startswith('video/mp4; codecs="avc1.')
    assert result["seqs"] == [1, 2, 3]  # the live edge, then what follows
    # one range, from the first fragment's start to the last's end: the timeline is continuous
    assert result["ranges"] == [
        [pytest.approx(1 * PERIOD_S, abs=0.02), pytest.approx(4 * PERIOD_S, abs=0.02)]
    ]
    assert result["readyState"] >= 2 and result["size"] == [WIDTH, HEIGHT]

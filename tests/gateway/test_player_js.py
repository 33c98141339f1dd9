"""The playground's pure helpers (``static/player.js``) under Node: the texts it shows and
how it paces the frames it draws. Skipped without Node."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

PLAYER = Path(__file__).resolve().parents[2] / "services" / "gateway" / "static" / "player.js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="no node to run the page's script")


def run_js(body: str) -> object:
    """Run ``body`` with ``player`` bound to player.js's exports; its last line prints JSON."""
    script = f"const player = require({json.dumps(str(PLAYER))});\n{body}"
    out = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_ack_texts_never_say_a_close_is_unconfirmed():
    texts = run_js("""
        console.log(JSON.stringify([
          player.ackText({control: "close", confirmed: true, next_seq: null, last_seq: 41}),
          player.ackText({control: "close", confirmed: true, next_seq: null, last_seq: -1}),
          player.ackText({control: "prompt", confirmed: true, next_seq: 14}),
          player.ackText({control: "pause", confirmed: false, next_seq: null}),
        ]));""")
    assert texts == ["closed after seq 41", "closed", "done, from seq 14",
                     "accepted; the worker has not confirmed it yet"]

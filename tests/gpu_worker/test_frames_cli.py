"""``turboserve frames``: the README's way to look at frames works where only the service is
installed (the virtual environment ``scripts/run.sh`` makes has no pytest)."""

from __future__ import annotations

import subprocess
import sys

from PIL import Image

# ``import pytest`` fails in this child, as it does in that environment.
WITHOUT_PYTEST = """
import sys
sys.modules["pytest"] = None
from tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_frames_writes_a_strip_without_test_tools(tmp_path):
    out = tmp_path / "alive.png"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_PYTEST, "frames", str(out), "--chunks", "2", "--every", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{out}: rows ") and "spatial std" in proc.stdout
    with Image.open(out) as image:
        width, height = image.size
    assert height > 0 and width > height  # three rows of several frames each, side by side


def test_frames_refuses_bad_counts_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "frames", "--chunks", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "--chunks must be >= 2" in proc.stderr

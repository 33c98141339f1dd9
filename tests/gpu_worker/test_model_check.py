"""``turboserve model check``: one line per component, non-zero exit when a worker could not
run the folder; run as users run it (the CLI, in a subprocess)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import save_file

from services.gpu_worker.model.checkpoint import from_diffusers
from tests.models import build_folder, build_transformer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    return {layout: build_folder(root / layout, layout) for layout in ("diffusers", "original")}


def check(*args: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "model", "check", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_a_folder_a_worker_can_run(folders, layout):
    code, out = check(str(folders[layout]), "--resolution", "64x64", "--gpu-memory", "0.05")
    assert code == 0, out
    assert f"({layout} layout)" in out and "a worker can run this model" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(lines) == {"text", "tokenizer", "VAE", "DiT", "video", "memory:", "sessions"}
    assert "one slot" in lines["memory:"] and "at 64x64" in lines["memory:"]
    counts = [line for line in out.splitlines() if "sessions per GPU:" in line]
    assert len(counts) == 2 and all("(--gpu-memory)" in line for line in counts), out
    every, one = (int(line.split("sessions per GPU: ")[1].split()[0]) for line in counts)
    assert 1 <= every < one  # one decode a pass leaves room for more sessions
    assert "umT5 encoder, d_model 24" in lines["text"] and "parameters" in lines["text"]
    assert "AutoencoderKLWan z_dim 16" in lines["VAE"] and "decoder cache" in lines["VAE"]
    assert "dim 32, 2 layers, 2 heads" in lines["DiT"] and "KV state" in lines["DiT"]
    assert all(" ok " in lines[part] for part in ("text", "tokenizer", "VAE", "DiT"))


@pytest.mark.slow
def test_missing_parts_and_misfits_are_named_and_fail(folders, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folders["diffusers"], broken)
    shutil.rmtree(broken / "transformer")
    code, out = check(str(broken))
    assert code == 1 and "DiT" in out and "missing" in out and "could not run" in out
    # A DiT that takes text of another width than the text encoder gives.
    other = tmp_path / "other.safetensors"
    model = build_transformer()
    tensors = {k: v.contiguous() for k, v in from_diffusers(dict(model.state_dict())).items()}
    tensors["text_embedding.0.weight"] = tensors["text_embedding.0.weight"][:, :20].contiguous()
    save_file(tensors, str(other))
    code, out = check(str(folders["diffusers"]), "--checkpoint", str(other))
    assert code == 1 and "takes text of width 20" in out and "gives 24" in out, out


def test_no_folder_is_one_line(tmp_path):
    code, out = check(str(tmp_path / "nowhere"))
    assert code == 1 and "does not exist" in out and "Traceback" not in out


@pytest.mark.slow
def test_the_video_line_says_the_size_the_chunk_bound_and_whether_it_fits(folders):
    """The resolution it runs at (Wan2.1's with none set), a chunk's bytes at the bitrate, and
    the max_payload checked against: given, or NATS's default when no server answers."""
    code, out = check(str(folders["diffusers"]), "--max-payload", "1048576")
    [video] = [line for line in out.splitlines() if line.startswith("  video")]
    assert code == 0 and "480x832 (Wan2.1's" in video and "12 frames per 0.75 s" in video
    assert "TURBOSERVE_VIDEO_BITRATE=2000000" in video and "fits max_payload 1048576" in video
    code, out = check(str(folders["diffusers"]), "--max-payload", "100000")
    assert code == 1 and "does NOT fit max_payload 100000 (--max-payload)" in out
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "model", "check", str(folders["diffusers"])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TURBOSERVE_NATS_URL": "nats://127.0.0.1:1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NATS's default: no server answered" in proc.stdout and "Traceback" not in proc.stderr

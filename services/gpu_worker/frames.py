"""``turboserve frames [OUT.png]``: look at what the model makes, without the services.

Runs the engine on the CPU for a few sessions alone (a prompt and a seed each), and writes one
row of frames per session, left to right, as a PNG; prints a few figures of the frames (spatial
contrast, motion within and across chunks). Needs what the worker needs and nothing else (no
test tools): it runs in the virtual environment ``scripts/run.sh`` makes.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FOX = "a red fox running through snow"
WHALE = "a blue whale in the deep ocean"
SESSIONS = ((FOX, 1), (FOX, 2), (WHALE, 1))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "frames",
        help="write a strip of the model's frames as a PNG (no services needed)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", nargs="?", default="/tmp/alive.png", help="the PNG to write")
    p.add_argument("--preset", default="tiny", help="model preset: tiny, small, wan-1.3b")
    p.add_argument("--chunks", type=int, default=8, help="chunks per session (default 8)")
    p.add_argument("--every", type=int, default=3, help="keep one frame in this many")
    p.set_defaults(func=run)


def clip(prompt: str, seed: int, chunks: int, preset: str = "tiny") -> list[torch.Tensor]:
    """The frames of one session alone on a fresh CPU engine, one ``[n, H, W, 3]`` tensor per
    chunk (a chunk's frame count is the model's: it may differ between chunks)."""
    from services.gpu_worker.engine import Engine, EngineConfig, next_chunks

    engine = Engine(EngineConfig(preset=preset, device="cpu", max_sessions=1, seed=0))
    engine.add_session("s", prompt, seed)
    return [next_chunks(engine)[0].frames.float() for _ in range(chunks)]


def save_strip(rows: list[torch.Tensor], path: Path | str, every: int = 3) -> Path:
    """One row per clip (``[frames, H, W, 3]``), every ``every``-th frame from left to right."""
    import torch
    from PIL import Image

    width = min(len(frames[::every]) for frames in rows)
    strip = torch.cat([torch.cat(list(frames[::every][:width]), dim=1) for frames in rows], dim=0)
    path = Path(path)
    Image.fromarray(strip.clamp(0, 255).to(torch.uint8).numpy()).save(path)
    return path


def motion(chunks: list[torch.Tensor]) -> tuple[float, float]:
    """Mean absolute change between consecutive frames (levels of 255), within a chunk and
    across chunk boundaries, leaving out the first chunk (its fade-in from grey)."""
    import torch

    within = [float((c[1:] - c[:-1]).abs().mean()) for c in chunks[1:] if len(c) > 1]
    across = [float((b[0] - a[-1]).abs().mean()) for a, b in itertools.pairwise(chunks[1:])]

    def mean(xs: list[float]) -> float:
        return float(torch.tensor(xs).mean()) if xs else float("nan")

    return mean(within), mean(across)


def run(args: argparse.Namespace) -> int:
    import torch

    from shared.cli import fail

    if args.chunks < 2 or args.every < 1:
        return fail("frames", "--chunks must be >= 2 and --every >= 1")
    torch.set_num_threads(1)
    clips = [clip(prompt, seed, args.chunks, args.preset) for prompt, seed in SESSIONS]
    rows = [torch.cat(chunks) for chunks in clips]
    path = save_strip(rows, args.out, args.every)
    counts = sorted({len(c) for c in clips[0]})
    print(
        f"{path}: rows {FOX!r} seed 1, seed 2, {WHALE!r} seed 1; one frame in {args.every} "
        f"of {args.chunks} chunks ({'/'.join(map(str, counts))} frames each), left to right"
    )
    for (prompt, seed), chunks, row in zip(SESSIONS, clips, rows, strict=True):
        contrast = float(row[len(chunks[0]) :].std(dim=(1, 2)).mean(dim=1).median())
        within, across = motion(chunks)
        print(
            f"  {prompt!r} seed {seed}: spatial std {contrast:.1f}, frame-to-frame change "
            f"{within:.1f} in a chunk / {across:.1f} across chunks (levels of 255)"
        )
    return 0

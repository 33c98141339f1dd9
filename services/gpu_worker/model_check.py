"""``turboserve model check <folder> [--checkpoint FILE]``: can a worker run this model?

One line per component (text encoder, tokenizer, VAE, DiT): what was found, its format, dtype,
parameter count and the memory it needs (weights in the worker's dtype, plus the per-session
state it adds), or what is missing or does not fit. Weights are not loaded: shapes come from
safetensors headers, configs and memory-mapped ``.pth`` files, and every key is checked against
the model the worker would build (on the meta device). Then the video: the resolution the folder
will run at (``--resolution``, else ``TURBOSERVE_RESOLUTION``, else Wan2.1's 480x832), the most
bytes a chunk takes at ``TURBOSERVE_VIDEO_BITRATE`` and whether its NATS message fits the
``max_payload`` (``--max-payload``, else the server's at ``TURBOSERVE_NATS_URL``, else NATS's
default 1 MiB when no server answers; the line says which). Exits 1 when a worker could not run
it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.gpu_worker.model.folder import (
    COMPONENTS,
    Component,
    ModelFolder,
    ModelFolderError,
    dit_files,
    dit_heads,
    find_components,
)

if TYPE_CHECKING:
    from shared.settings import WorkerSettings

BF16 = 2
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1}


@dataclass(frozen=True, slots=True)
class Report:
    """One line of ``turboserve model check``."""

    component: str
    ok: bool
    text: str


def tensor_summary(files: list[Path]) -> tuple[int, str, int]:
    """(parameters, dtype(s), bytes) of weight files, from safetensors headers or a memory-mapped
    ``.pth`` (no tensor data is read)."""
    params, nbytes, dtypes = 0, 0, set()
    for path in files:
        if path.suffix == ".safetensors":
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                count = math.prod(info["shape"])
                params += count
                nbytes += count * _BYTES.get(info["dtype"], 4)
                dtypes.add(info["dtype"].lower())
        else:
            import torch

            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            if isinstance(state, dict):
                for value in state.values():
                    if isinstance(value, dict):  # a training checkpoint's nested state dicts
                        tensors = [v for v in value.values() if isinstance(v, torch.Tensor)]
                    else:
                        tensors = [value] if isinstance(value, torch.Tensor) else []
                    for tensor in tensors:
                        params += tensor.numel()
                        nbytes += tensor.numel() * tensor.element_size()
                        dtypes.add(str(tensor.dtype).removeprefix("torch."))
    return params, "/".join(sorted(dtypes)) or "?", nbytes


def weight_files(component: Component) -> list[Path]:
    path = component.path
    if path is None:
        return []
    if path.is_file():
        return [path]
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "model", help="inspect a Wan2.1 model folder: model check FOLDER [--checkpoint FILE]"
    )
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    check = sub.add_parser(
        "check",
        help="one line per component: found, format, dtype, "
        "parameters, memory; exit 1 if a worker could not run it",
    )
    check.add_argument(
        "folder", type=Path, help="a Wan2.1 text-to-video folder (diffusers or original layout)"
    )
    check.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="the causal DiT (Self-Forcing/LongLive .pt, safetensors); default: the folder's",
    )
    check.add_argument(
        "--resolution",
        default=None,
        help="video HEIGHTxWIDTH it runs at (default: TURBOSERVE_RESOLUTION, else 480x832)",
    )
    check.add_argument(
        "--max-payload",
        type=int,
        default=None,
        help="the NATS max_payload (bytes) to check a chunk against (default: the server's at "
        "TURBOSERVE_NATS_URL, else NATS's default 1 MiB)",
    )
    check.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="the GPU memory (GiB) the session count is given for; default: this host's "
        "first GPU, else 80",
    )
    check.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.settings import SettingsError, WorkerSettings, parse_resolution

    try:
        settings = WorkerSettings.from_env()
    except SettingsError as exc:
        print(f"model check: {exc}", file=sys.stderr)
        return 2
    given = args.resolution or settings.resolution
    resolution = parse_resolution(given or DEFAULT_RESOLUTION)
    if resolution is None:
        print(f"model check: resolution {given!r}: HEIGHTxWIDTH, multiples of 16", file=sys.stderr)
        return 2
    source = (
        "--resolution"
        if args.resolution
        else "TURBOSERVE_RESOLUTION"
        if settings.resolution
        else "Wan2.1's, no TURBOSERVE_RESOLUTION set"
    )
    try:
        folder = find_components(args.folder, args.checkpoint)
    except ModelFolderError as exc:
        print(f"model check: {exc}", file=sys.stderr)
        return 1
    facts: dict[str, int | None] = {}
    reports = check(folder, resolution, facts)
    print(f"{folder.root} ({folder.layout} layout)")
    width = max(len(name) for name in COMPONENTS)
    for report in reports:
        print(f"  {report.component:<{width}}  {'ok  ' if report.ok else 'FAIL'}  {report.text}")
    video = video_report(settings, resolution, source, args.max_payload)
    print(f"  {video.component:<{width}}  {'ok  ' if video.ok else 'FAIL'}  {video.text}")
    ok = all(r.ok for r in reports) and video.ok
    if ok:
        gpu = gpu_bytes(args.gpu_memory)
        for line in memory_lines(facts, gpu, resolution):
            print(f"  {line}")
    print("a worker can run this model" if ok else "a worker could not run this model")
    return 0 if ok else 1


DEFAULT_RESOLUTION = "480x832"  # Wan2.1's: what a loaded model runs at with none set


def video_report(
    settings: WorkerSettings,
    resolution: tuple[int, int],
    source: str,
    max_payload: int | None,
) -> Report:
    """The video a worker would send of this folder: its size, a chunk's bound at the
    bitrate, and whether its message fits NATS's max_payload."""
    from services.gpu_worker.encoder import chunk_duration_s
    from services.gpu_worker.model.config import get_preset
    from shared.settings import DEFAULT_CHUNK_PERIOD_S
    from shared.video import chunk_bytes_limit, chunk_wire_bytes

    frames = get_preset("wan-1.3b").video_frames_per_chunk
    period = DEFAULT_CHUNK_PERIOD_S if settings.chunk_period_s is None else settings.chunk_period_s
    duration = chunk_duration_s(frames, period)
    if max_payload is not None:
        limit, where = max_payload, "--max-payload"
    else:
        limit, where = server_max_payload(settings.nats_url)
    bitrate = settings.video_bitrate
    wire = chunk_wire_bytes(bitrate, duration)
    fits = wire <= limit
    text = (
        f"{resolution[0]}x{resolution[1]} ({source}), {frames} frames per {duration:g} s chunk: "
        f"at most {human_bytes(chunk_bytes_limit(bitrate, duration))} of H.264 at "
        f"TURBOSERVE_VIDEO_BITRATE={bitrate}, {wire} bytes on NATS; "
        f"{'fits' if fits else 'does NOT fit'} max_payload {limit} ({where})"
    )
    return Report("video", fits, text)


def server_max_payload(url: str) -> tuple[int, str]:
    """The max_payload of the NATS server at ``url`` and where the figure comes from: the
    server, or NATS's default when none answers (within two seconds)."""
    import asyncio

    from shared.settings import mask_url, nats_servers
    from shared.video import NATS_DEFAULT_MAX_PAYLOAD

    async def quiet(_: Exception) -> None:
        return None

    async def ask() -> int:
        import nats

        nc = await nats.connect(
            nats_servers(url),
            connect_timeout=2,
            max_reconnect_attempts=0,
            allow_reconnect=False,
            error_cb=quiet,
        )
        try:
            return int(nc.max_payload)
        finally:
            await nc.close()

    try:
        return asyncio.run(asyncio.wait_for(ask(), 5)), f"the server at {mask_url(url)}"
    except Exception:  # noqa: BLE001 - no server: the default, said so
        return NATS_DEFAULT_MAX_PAYLOAD, f"NATS's default: no server answered at {mask_url(url)}"


def gpu_bytes(gib: float | None) -> tuple[int, str]:
    """The GPU memory the session count is given for, and where that figure comes from."""
    if gib is not None:
        return int(gib * (1 << 30)), "--gpu-memory"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), props.name
    return 80 << 30, "no GPU here: an 80 GiB card"


def memory_lines(
    facts: dict[str, int | None], gpu: tuple[int, str], resolution: tuple[int, int]
) -> list[str]:
    """What one slot takes and the sessions per GPU the worker's memory budget gives
    (``engine/memory.py``), with the decode's peak estimated (a worker measures it at start)."""
    from services.gpu_worker.engine.memory import (
        MemoryBudget,
        MemoryBudgetExceeded,
        estimated_decode_peak,
        plan,
    )

    total, source = gpu
    slot, weights = facts.get("slot_bytes") or 0, facts.get("weights_bytes") or 0
    peak = estimated_decode_peak(facts.get("decoder_bytes") or 0, facts.get("frame_bytes") or 0)
    lines = [
        f"memory: one slot {human_bytes(slot)} at {resolution[0]}x{resolution[1]} (KV, "
        f"cross-attention, latents, VAE cache, chunk in progress); weights "
        f"{human_bytes(weights)} in bf16; a decode's peak about {human_bytes(peak)} (estimated)"
    ]
    for decodes in (None, 1):
        budget = MemoryBudget(
            f"a {human_bytes(total)} GPU", total - weights, slot, peak, False, decodes
        )
        try:
            sessions = plan(budget, None, 256).sessions
        except MemoryBudgetExceeded:
            sessions = 0
        bound = "every chunk decoded in its pass" if decodes is None else "one decode a pass"
        lines.append(
            f"sessions per GPU: {sessions} on {human_bytes(total)} ({source}), {bound} "
            "(TURBOSERVE_MAX_DECODES_PER_PASS)"
        )
    return lines


def check(
    folder: ModelFolder, resolution: tuple[int, int], facts: dict[str, int | None] | None = None
) -> list[Report]:
    facts = {} if facts is None else facts
    checks: dict[str, Callable[[Component, dict[str, int | None], tuple[int, int]], str]] = {
        "text encoder": _text_encoder,
        "tokenizer": _tokenizer,
        "VAE": _vae,
        "DiT": _dit,
    }
    reports = []
    for name in COMPONENTS:
        part = folder.get(name)
        if part.path is None:
            hint = " (set --checkpoint / TURBOSERVE_CHECKPOINT)" if name == "DiT" else ""
            reports.append(Report(name, False, f"missing{hint}"))
            continue
        facts["heads"] = dit_heads(folder)
        try:
            reports.append(Report(name, True, checks[name](part, facts, resolution)))
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            reports.append(Report(name, False, f"{part.path} ({part.fmt}): {exc}"))
    return reports


def _where(part: Component) -> str:
    return f"{part.path} ({part.fmt})"


def _weights(files: list[Path]) -> tuple[str, int]:
    params, dtype, _ = tensor_summary(files)
    return (
        f"{dtype}, {human_count(params)} parameters, {human_bytes(params * BF16)} in bf16",
        params,
    )


def _text_encoder(part: Component, facts: dict[str, int | None], _: tuple[int, int]) -> str:
    from transformers import UMT5Config

    from services.gpu_worker.model.text import fit_original_umt5

    assert part.path is not None
    if part.fmt == "wan .pth":
        config = fit_original_umt5(part.path)[1].config
    else:
        config = UMT5Config.from_pretrained(str(part.path))
    facts["text_dim"] = int(config.d_model)
    weights, params = _weights(weight_files(part))
    facts["weights_bytes"] = (facts.get("weights_bytes") or 0) + params * BF16
    return (
        f"{_where(part)}: umT5 encoder, d_model {config.d_model}, {config.num_layers} "
        f"layers, {weights}"
    )


def _tokenizer(part: Component, facts: dict[str, int | None], _: tuple[int, int]) -> str:
    from transformers import AutoTokenizer

    assert part.path is not None
    tokenizer = AutoTokenizer.from_pretrained(str(part.path), local_files_only=True)
    return f"{_where(part)}: {type(tokenizer).__name__}, {len(tokenizer)} tokens"


def _vae(part: Component, facts: dict[str, int | None], resolution: tuple[int, int]) -> str:
    import torch

    from services.gpu_worker.model.vae import cache_layout, fit_original_vae, wan_vae

    assert part.path is not None
    if part.fmt == "wan .pth":
        vae = fit_original_vae(str(part.path))[1]
    else:
        config = json.loads((part.path / "config.json").read_text())
        with torch.device("meta"):
            vae = wan_vae(**{k: v for k, v in config.items() if not k.startswith("_")})
    z_dim, base_dim = vae.config["z_dim"], vae.config["base_dim"]
    facts["z_dim"] = int(z_dim)
    latent = (resolution[0] // 8, resolution[1] // 8)
    cache = cache_layout(vae, latent).numel * BF16
    facts["decoder_numel"] = cache_layout(vae, latent).numel
    weights, params = _weights(weight_files(part))
    facts["weights_bytes"] = (facts.get("weights_bytes") or 0) + params * BF16
    return (
        f"{_where(part)}: AutoencoderKLWan z_dim {z_dim}, base {base_dim}, "
        f"{weights}; decoder cache {human_bytes(cache)} per session at "
        f"{resolution[0]}x{resolution[1]}"
    )


def _dit(part: Component, facts: dict[str, int | None], resolution: tuple[int, int]) -> str:
    import torch

    from services.gpu_worker.engine.slots import SlotPool
    from services.gpu_worker.model.checkpoint import dit_geometry, load_tensors, read_checkpoint
    from services.gpu_worker.model.dit import CausalWanModel
    from services.gpu_worker.model.load import WAN_TEXT_LEN, config_for

    assert part.path is not None
    files = dit_files(part.path)
    if not files:
        raise ValueError("no diffusion_pytorch_model*.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(read_checkpoint(path))
    geometry = dit_geometry(tensors)
    heads = facts.get("heads")
    config = config_for(geometry, int(heads) if heads else None, None, WAN_TEXT_LEN, resolution)
    with torch.device("meta"):
        load_tensors(CausalWanModel(config), tensors, str(part.path))  # CheckpointMismatch
    problems = []
    if facts.get("text_dim") not in (None, config.text_dim):
        problems.append(
            f"takes text of width {config.text_dim} (text_embedding.0.weight), the "
            f"text encoder gives {facts['text_dim']}"
        )
    if facts.get("z_dim") not in (None, config.out_dim):
        problems.append(
            f"makes {config.out_dim} latent channels (head.head.weight), the VAE "
            f"takes {facts['z_dim']}"
        )
    if problems:
        raise ValueError("; ".join(problems))
    with torch.device("meta"):
        pool = SlotPool(config, 1, torch.device("meta"), torch.bfloat16, 0)
        decoder = int(facts.get("decoder_numel") or 0)
        whole = SlotPool(config, 0, torch.device("meta"), torch.bfloat16, decoder)
    params = sum(math.prod(t.shape) for t in tensors.values())
    facts["slot_bytes"] = whole.memory_per_slot
    facts["decoder_bytes"] = decoder * BF16
    facts["frame_bytes"] = config.video_frames_per_chunk * config.height * config.width * 3 * 4
    facts["weights_bytes"] = (facts.get("weights_bytes") or 0) + params * BF16
    dtypes = "/".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}))
    return (
        f"{_where(part)}: dim {config.dim}, {config.num_layers} layers, {config.num_heads} "
        f"heads, {dtypes}, {human_count(params)} parameters, "
        f"{human_bytes(params * BF16)} in bf16; KV state {human_bytes(pool.bytes_per_slot)} "
        f"per session at {resolution[0]}x{resolution[1]}"
    )

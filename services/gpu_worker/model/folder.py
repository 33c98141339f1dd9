"""A Wan2.1 text-to-video model folder, in either layout users download, found and described.

- **diffusers layout** (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``): ``text_encoder/`` (umT5,
  ``config.json`` + safetensors), ``tokenizer/``, ``vae/`` (``AutoencoderKLWan``), optionally
  ``transformer/`` (``WanTransformer3DModel``);
- **original layout** (``Wan-AI/Wan2.1-T2V-1.3B``): ``models_t5_umt5-xxl-enc-bf16.pth`` (the
  umT5 encoder), ``Wan2.1_VAE.pth``, the ``google/umt5-xxl/`` tokenizer folder, and the DiT as
  ``diffusion_pytorch_model*.safetensors`` with Wan's ``config.json``.

``find_components`` only looks at names; ``inspect`` also reads what each file says of itself
(safetensors headers, configs; ``.pth`` files through a memory map) without loading weights, for
``turboserve model check``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

COMPONENTS = ("text encoder", "tokenizer", "VAE", "DiT")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json")
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1,
          "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True, slots=True)
class Component:
    name: str  # one of COMPONENTS
    path: Path | None  # None: not found
    fmt: str  # "diffusers", "transformers", "wan .pth", "safetensors", ".pt", ...


@dataclass(slots=True)
class ModelFolder:
    root: Path
    layout: str  # "diffusers" or "original"
    components: dict[str, Component] = field(default_factory=dict)

    def get(self, name: str) -> Component:
        return self.components[name]


class ModelFolderError(ValueError):
    """The folder cannot be used; names the component and what is wrong with it."""

    retryable = False


def find_components(root: str | Path, checkpoint: str | Path | None = None) -> ModelFolder:
    """The folder's components by name (``checkpoint``, when given, is the DiT)."""
    root = Path(root)
    if not root.is_dir():
        raise ModelFolderError(f"model folder {root} does not exist or is not a folder")
    if (root / "vae").is_dir() or (root / "text_encoder").is_dir():
        folder = ModelFolder(root, "diffusers")
        parts = {
            "text encoder": _dir_if(root / "text_encoder", "config.json"),
            "tokenizer": _tokenizer_dir(root / "tokenizer"),
            "VAE": _dir_if(root / "vae", "config.json"),
            "DiT": _dir_if(root / "transformer", "config.json"),
        }
        formats = {"text encoder": "transformers", "tokenizer": "transformers",
                   "VAE": "diffusers", "DiT": "diffusers"}
    else:
        folder = ModelFolder(root, "original")
        parts = {
            "text encoder": _first(root.glob("*umt5*.pth")) or _first(root.glob("*t5*.pth")),
            "tokenizer": _tokenizer_dir(root / "google" / "umt5-xxl") or _tokenizer_dir(root),
            "VAE": _first(root.glob("*VAE*.pth")) or _first(root.glob("*vae*.pth")),
            "DiT": root if _first(root.glob("diffusion_pytorch_model*.safetensors")) else None,
        }
        formats = {"text encoder": "wan .pth", "tokenizer": "transformers", "VAE": "wan .pth",
                   "DiT": "wan safetensors"}
    for name in COMPONENTS:
        folder.components[name] = Component(name, parts[name], formats[name])
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_file():
            raise ModelFolderError(f"DiT checkpoint {path} does not exist")
        folder.components["DiT"] = Component("DiT", path, path.suffix.lstrip(".") or "file")
    return folder


def _dir_if(path: Path, marker: str) -> Path | None:
    return path if (path / marker).is_file() else None


def _tokenizer_dir(path: Path) -> Path | None:
    if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
        return path
    return None


def _first(paths: object) -> Path | None:
    found = sorted(p for p in paths if p.is_file())  # type: ignore[attr-defined]
    return found[0] if found else None


def dit_files(path: Path) -> list[Path]:
    """A DiT component's weight files: the file itself, or a folder's safetensors shards."""
    if path.is_file():
        return [path]
    return sorted(path.glob("diffusion_pytorch_model*.safetensors"))


def dit_heads(folder: ModelFolder) -> int | None:
    """Attention heads from a DiT config beside the weights (diffusers ``transformer/`` or
    Wan's own ``config.json``); None when there is none."""
    candidates = [folder.root / "transformer" / "config.json", folder.root / "config.json"]
    for path in candidates:
        if path.is_file():
            config = json.loads(path.read_text())
            heads = config.get("num_attention_heads", config.get("num_heads"))
            if heads:
                return int(heads)
    return None


# -- describing, without loading ----------------------------------------------------------------
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

"""A Wan2.1 text-to-video model folder, in either layout users download, found and described.

- **diffusers layout** (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``): ``text_encoder/`` (umT5,
  ``config.json`` + safetensors), ``tokenizer/``, ``vae/`` (``AutoencoderKLWan``), optionally
  ``transformer/`` (``WanTransformer3DModel``);
- **original layout** (``Wan-AI/Wan2.1-T2V-1.3B``): ``models_t5_umt5-xxl-enc-bf16.pth`` (the
  umT5 encoder), ``Wan2.1_VAE.pth``, the ``google/umt5-xxl/`` tokenizer folder, and the DiT as
  ``diffusion_pytorch_model*.safetensors`` with Wan's ``config.json``.

``find_components`` only looks at names (``turboserve model check`` reads the files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

COMPONENTS = ("text encoder", "tokenizer", "VAE", "DiT")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json")


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
        formats = {
            "text encoder": "transformers",
            "tokenizer": "transformers",
            "VAE": "diffusers",
            "DiT": "diffusers",
        }
    else:
        folder = ModelFolder(root, "original")
        parts = {
            "text encoder": _first(root.glob("*umt5*.pth")) or _first(root.glob("*t5*.pth")),
            "tokenizer": _tokenizer_dir(root / "google" / "umt5-xxl") or _tokenizer_dir(root),
            "VAE": _first(root.glob("*VAE*.pth")) or _first(root.glob("*vae*.pth")),
            "DiT": root if _first(root.glob("diffusion_pytorch_model*.safetensors")) else None,
        }
        formats = {
            "text encoder": "wan .pth",
            "tokenizer": "transformers",
            "VAE": "wan .pth",
            "DiT": "wan safetensors",
        }
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

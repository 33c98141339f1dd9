"""Load a safetensors checkpoint in the public Wan2.1 / Self-Forcing causal layout.

Key mapping. ``CausalWanModel`` uses Wan2.1's own module names, so after a wrapper prefix is
removed a key maps to the parameter of the same name:

| checkpoint key (after prefix)                     | shape (1.3B)          |
| ------------------------------------------------- | --------------------- |
| patch_embedding.{weight,bias}                     | [1536, 16, 1, 2, 2]   |
| text_embedding.{0,2}.{weight,bias}                | [1536, 4096], [1536, 1536] |
| time_embedding.{0,2}.{weight,bias}                | [1536, 256], [1536, 1536] |
| time_projection.1.{weight,bias}                   | [9216, 1536]          |
| blocks.N.self_attn.{q,k,v,o}.{weight,bias}        | [1536, 1536]          |
| blocks.N.self_attn.norm_{q,k}.weight              | [1536]                |
| blocks.N.cross_attn.{q,k,v,o}.{weight,bias}       | [1536, 1536]          |
| blocks.N.cross_attn.norm_{q,k}.weight             | [1536]                |
| blocks.N.norm3.{weight,bias}                      | [1536]                |
| blocks.N.ffn.{0,2}.{weight,bias}                  | [8960, 1536], [1536, 8960] |
| blocks.N.modulation                               | [1, 6, 1536]          |
| head.head.{weight,bias}                           | [64, 1536]            |
| head.modulation                                   | [1, 2, 1536]          |

Prefixes removed (any combination, outermost first): ``generator_ema.``, ``generator.``
(Self-Forcing's training checkpoints), ``model.`` (its ``WanDiffusionWrapper``),
``diffusion_model.`` (ComfyUI exports), ``module.`` (DDP) and ``_orig_mod.`` (torch.compile).
Image-to-video keys (``img_emb.*``, ``cross_attn.{k,v}_img``) are not part of this text-to-video
model and are reported as unexpected. Self-Forcing ships ``.pt`` files; convert one with
``safetensors.torch.save_file(torch.load(p)["generator_ema"], out)``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

PREFIXES = ("generator_ema.", "generator.", "model.", "diffusion_model.", "module.", "_orig_mod.")


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit the model: names what is missing, extra or misshapen."""

    def __init__(
        self, path: str, missing: list[str], unexpected: list[str], misshapen: list[str]
    ) -> None:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
            if keys:
                parts.append(f"{len(keys)} {label} (e.g. {', '.join(keys[:3])})")
        super().__init__(f"checkpoint {path} does not fit the model: " + "; ".join(parts))
        self.missing = missing
        self.unexpected = unexpected
        self.misshapen = misshapen


def strip_prefixes(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                changed = True
    return key


def map_keys(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys to model parameter names (see the table in the module docstring)."""
    mapped: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = strip_prefixes(key)
        if name in mapped:
            raise ValueError(f"two checkpoint keys map to {name!r}")
        mapped[name] = tensor
    return mapped


def load_checkpoint(model: nn.Module, path: str | Path, strict: bool = True) -> list[str]:
    """Copies the checkpoint's weights into ``model`` (casting to its dtype and device).

    Returns the checkpoint keys that were not used (only possible with ``strict=False``).
    """
    from safetensors.torch import load_file

    path = str(path)
    tensors = map_keys(load_file(path, device="cpu"))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    misshapen = sorted(
        f"{name} {tuple(tensors[name].shape)} != {tuple(param.shape)}"
        for name, param in params.items()
        if name in tensors and tensors[name].shape != param.shape
    )
    if misshapen or (strict and (missing or unexpected)):
        raise CheckpointMismatch(path, missing, unexpected, misshapen)
    with torch.no_grad():
        for name, param in params.items():
            if name in tensors:
                param.copy_(tensors[name].to(device=param.device, dtype=param.dtype))
    return unexpected


def checkpoint_identity(path: str | Path) -> tuple[str, str]:
    """``(digest, description)`` of a checkpoint file: a content hash (blake2b, 128 bits; a
    streaming read, about a second per GB) and ``"<basename> (<size> bytes, blake2b <digest>)"``.
    Engines compare the digest so that a session's caches only move between workers holding
    the same weights, whatever the file is called."""
    path = Path(path)
    hasher = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            hasher.update(block)
    digest = hasher.hexdigest()
    return digest, f"{path.name} ({path.stat().st_size} bytes, blake2b {digest})"

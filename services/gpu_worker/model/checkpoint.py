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
model and are reported as unexpected. ``read_checkpoint`` also reads Self-Forcing's and
LongLive's ``.pt`` files directly, diffusers' ``WanTransformer3DModel`` naming, and LoRA pairs.
"""

from __future__ import annotations

import math
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
        for label, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("misshapen", misshapen),
        ):
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


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The DiT's tensors from a file, in the Wan layout (prefixes stripped, LoRA merged).

    - ``.safetensors``: read as is;
    - ``.pt`` / ``.pth`` (Self-Forcing, LongLive): loaded with ``weights_only=True`` (no code
      runs); a training checkpoint's ``generator_ema`` is taken, else ``generator``, else
      ``model`` or ``state_dict``, else the file is the state dict itself;
    - keys in diffusers' ``WanTransformer3DModel`` naming are renamed to Wan's
      (``DIFFUSERS_TO_WAN``);
    - LoRA pairs (``<name>.lora_A[.default].weight`` and ``lora_B``, as LongLive's adapter
      saves them) are merged into ``<name>.weight`` with scale ``lora_scale`` (alpha / rank).
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        raw: object = load_file(str(path), device="cpu")
    elif path.suffix in (".pt", ".pth", ".bin"):
        raw = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        if isinstance(raw, dict):
            for wrapper in ("generator_ema", "generator", "model", "state_dict"):
                if isinstance(raw.get(wrapper), dict):
                    raw = raw[wrapper]
                    break
    else:
        raise ValueError(
            f"checkpoint {path}: unknown format {path.suffix!r} (.safetensors, .pt or .pth)"
        )
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise ValueError(f"checkpoint {path}: not a state dict of tensors")
    return from_diffusers(merge_lora(map_keys(raw)))


def has_lora(path: str | Path) -> bool:
    """Whether the file carries LoRA pairs (LongLive's adapter), from its key names alone."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return any(".lora_A." in key for key in f.keys())  # noqa: SIM118
    raw = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    stack = [raw]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if any(isinstance(k, str) and ".lora_A." in k for k in item):
                return True
            stack.extend(v for v in item.values() if isinstance(v, dict))
    return False


def load_checkpoint(model: nn.Module, path: str | Path, strict: bool = True) -> list[str]:
    """Copies the checkpoint's weights into ``model`` (casting to its dtype and device).

    Returns the checkpoint keys that were not used (only possible with ``strict=False``).
    """
    return load_tensors(model, read_checkpoint(path), str(path), strict)


def load_tensors(
    model: nn.Module, tensors: dict[str, torch.Tensor], source: str, strict: bool = True
) -> list[str]:
    """``load_checkpoint`` for tensors already read (in the Wan layout)."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    misshapen = sorted(
        f"{name} {tuple(tensors[name].shape)} != {tuple(param.shape)}"
        for name, param in params.items()
        if name in tensors and tensors[name].shape != param.shape
    )
    if misshapen or (strict and (missing or unexpected)):
        raise CheckpointMismatch(source, missing, unexpected, misshapen)
    with torch.no_grad():
        for name, param in params.items():
            if name in tensors:
                param.copy_(tensors[name].to(device=param.device, dtype=param.dtype))
    return unexpected


# diffusers' WanTransformer3DModel names -> Wan2.1's (per block: ``blocks.N.`` + the key).
DIFFUSERS_TO_WAN = {
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "proj_out": "head.head",
    "scale_shift_table": "head.modulation",
}
DIFFUSERS_BLOCK_TO_WAN = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn1.norm_q": "self_attn.norm_q",
    "attn1.norm_k": "self_attn.norm_k",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.norm_q": "cross_attn.norm_q",
    "attn2.norm_k": "cross_attn.norm_k",
    # diffusers' norm2 is the cross-attention norm (Wan's norm3); its norm1 / norm3 have no
    # parameters.
    "norm2": "norm3",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
    "scale_shift_table": "modulation",
}


def from_diffusers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames diffusers ``WanTransformer3DModel`` keys to Wan's; other keys pass unchanged."""
    if not any(key.startswith("condition_embedder.") for key in tensors):
        return tensors
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        out[_wan_name(key)] = tensor
    return out


def _wan_name(key: str) -> str:
    stem, _, leaf = key.rpartition(".")
    if stem in DIFFUSERS_TO_WAN:
        return f"{DIFFUSERS_TO_WAN[stem]}.{leaf}"
    if key in DIFFUSERS_TO_WAN:  # a bare parameter (scale_shift_table)
        return DIFFUSERS_TO_WAN[key]
    parts = key.split(".")
    if parts[0] == "blocks" and len(parts) > 2:
        rest = ".".join(parts[2:])
        inner_stem, _, inner_leaf = rest.rpartition(".")
        if inner_stem in DIFFUSERS_BLOCK_TO_WAN:
            return f"blocks.{parts[1]}.{DIFFUSERS_BLOCK_TO_WAN[inner_stem]}.{inner_leaf}"
        if rest in DIFFUSERS_BLOCK_TO_WAN:
            return f"blocks.{parts[1]}.{DIFFUSERS_BLOCK_TO_WAN[rest]}"
    return key


def merge_lora(tensors: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Merges LoRA pairs into their base weights (``W + scale * B @ A``, in float32)."""
    downs = {k: v for k, v in tensors.items() if ".lora_A." in k}
    if not downs:
        return tensors
    # peft's wrapping: ``base_model.model.<name>.base_layer.weight`` is the base weight.
    tensors = {
        k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
        for k, v in tensors.items()
    }
    downs = {k: v for k, v in tensors.items() if ".lora_A." in k}
    out = {k: v for k, v in tensors.items() if ".lora_A." not in k and ".lora_B." not in k}
    for key, down in downs.items():
        base = key.split(".lora_A.")[0]
        up = tensors.get(key.replace(".lora_A.", ".lora_B."))
        name = base + ".weight"
        if up is None or name not in out:
            raise ValueError(f"LoRA {key}: no matching lora_B or base weight {name}")
        weight = out[name]
        out[name] = (weight.float() + scale * (up.float() @ down.float())).to(weight.dtype)
    return out


def dit_geometry(tensors: dict[str, torch.Tensor]) -> dict[str, object]:
    """The DiT's shape as its weights give it (Wan layout): every field but the heads, which
    no weight shape carries."""
    try:
        patch = tensors["patch_embedding.weight"]
        layers = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("blocks."))
        return {
            "dim": int(patch.shape[0]),
            "in_dim": int(patch.shape[1]),
            "patch": tuple(int(p) for p in patch.shape[2:]),
            "text_dim": int(tensors["text_embedding.0.weight"].shape[1]),
            "freq_dim": int(tensors["time_embedding.0.weight"].shape[1]),
            "ffn_dim": int(tensors["blocks.0.ffn.0.weight"].shape[0]),
            "num_layers": layers,
            "out_dim": int(tensors["head.head.weight"].shape[0]) // math.prod(patch.shape[2:]),
            "cross_attn_norm": "blocks.0.norm3.weight" in tensors,
        }
    except (KeyError, ValueError, IndexError) as exc:
        raise ValueError(f"the DiT's weights lack the Wan layout's {exc}") from None

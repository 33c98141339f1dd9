"""Text encoders behind one interface: prompt in, ``[max_len, dim]`` float32 embedding out.

- ``HashingTextEncoder``: the stand-in, built in, deterministic, no weights. Each word maps to
  a fixed random vector (seeded by a hash of the word) plus a position term, so the same prompt
  gives the same embedding on every machine and different prompts give different ones.
- ``UMT5TextEncoder``: Wan's real encoder, umT5 from ``transformers``, loaded from a model
  folder in the diffusers layout or from Wan2.1's original ``.pth``.
"""

from __future__ import annotations

import hashlib
import html
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import torch

_WORD = re.compile(r"\w+|[^\w\s]")


class TextEncoder(Protocol):
    name: str
    dim: int
    max_len: int

    def encode(self, prompt: str) -> torch.Tensor:
        """``[max_len, dim]`` float32 on the CPU; padding rows are zeros (as Wan pads umT5)."""
        ...


def _stable_seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class HashingTextEncoder:
    name = "hash"

    def __init__(self, dim: int, max_len: int, cache_size: int = 4096) -> None:
        self.dim = dim
        self.max_len = max_len
        self._vectors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_size = cache_size
        positions = torch.arange(max_len, dtype=torch.float64)[:, None]
        freqs = torch.pow(10000.0, -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = positions * freqs
        pos = torch.zeros(max_len, dim, dtype=torch.float64)
        pos[:, 0::2] = torch.sin(angles)
        pos[:, 1::2] = torch.cos(angles[:, : dim // 2])
        self._positions = (0.1 * pos).float()

    def _word_vector(self, word: str) -> torch.Tensor:
        vector = self._vectors.get(word)
        if vector is None:
            generator = torch.Generator().manual_seed(_stable_seed("word", self.dim, word))
            vector = torch.randn(self.dim, generator=generator)
            self._vectors[word] = vector
            if len(self._vectors) > self._cache_size:
                self._vectors.popitem(last=False)
        return vector

    def encode(self, prompt: str) -> torch.Tensor:
        words = _WORD.findall(prompt.lower())[: self.max_len]
        out = torch.zeros(self.max_len, self.dim)
        for i, word in enumerate(words):
            out[i] = self._word_vector(word) + self._positions[i]
        return out


class UMT5TextEncoder:
    """Wan's prompt encoder: umT5's encoder (``transformers.UMT5EncoderModel``) and its
    sentencepiece tokenizer, as Wan2.1 and diffusers' Wan pipeline run them: the prompt's
    whitespace collapsed, padded and truncated to ``max_len`` (512) tokens, the last hidden
    states with the padding rows set to zero. The engine caches its outputs per prompt and runs
    it off the generation pass (``engine.prompts``).

    ``device`` / ``dtype``: where it runs (bf16 on the GPU by default; umT5-XXL is 5.7 B
    parameters, 11.4 GB in bf16).

    On a GPU it runs on a CUDA stream of its own, at the lowest priority, and waits for that
    stream alone: on the default stream the pass's synchronisations would wait for umT5 and
    umT5 for the pass. (The engine, in turn, waits for its own stream, never the device.)"""

    name = "umt5"

    def __init__(self, model: Any, tokenizer: Any, max_len: int = 512) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.dim = int(model.config.d_model)
        self.max_len = max_len
        self._stream: torch.cuda.Stream | None = None

    @classmethod
    def from_folders(
        cls,
        model_dir: str | Path,
        tokenizer_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        max_len: int = 512,
    ) -> UMT5TextEncoder:
        """A diffusers-layout ``text_encoder/`` (``config.json`` + weights) and ``tokenizer/``."""
        from transformers import AutoTokenizer, UMT5EncoderModel
        from transformers.utils import logging as hf_logging

        # A worker's log is JSON lines, not progress bars. (transformers leaves it untyped.)
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        model = UMT5EncoderModel.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        # Moves in place. transformers wraps .to with functools.wraps, which mypy reads as a
        # plain function wanting the model as its first argument.
        model.to(device)  # type: ignore[arg-type]
        return cls(model, tokenizer, max_len)

    @classmethod
    def from_original(
        cls,
        path: str | Path,
        tokenizer_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        max_len: int = 512,
    ) -> UMT5TextEncoder:
        """Wan2.1's own ``models_t5_umt5-xxl-enc-bf16.pth``: its keys renamed to transformers'
        (``original_umt5_keys``), the config read off the weights' shapes."""
        from transformers import AutoTokenizer

        state, model = fit_original_umt5(path)
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        return cls(model.to(device=device, dtype=dtype), tokenizer, max_len)

    def encode(self, prompt: str, *, own_stream: bool = True) -> torch.Tensor:
        """``own_stream=False``: on the caller's current stream instead (what the GPU check
        compares the encoder's own stream with)."""
        device = next(self.model.parameters()).device
        stream = self.stream(device) if own_stream else None
        if stream is None:
            return self._encode(prompt, device)
        with torch.cuda.stream(stream):  # this thread's current stream, for the call only
            out = self._encode(prompt, device)
        stream.synchronize()
        return out

    def stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The encoder's own low-priority stream on a CUDA ``device`` (None on the CPU)."""
        if device.type != "cuda":
            return None
        if self._stream is None:
            # CUDA's priorities run from 0 (the lowest, the default's) to negative numbers.
            self._stream = torch.cuda.Stream(device=device, priority=0)  # type: ignore[no-untyped-call]
        return self._stream

    @torch.inference_mode()
    def _encode(self, prompt: str, device: torch.device) -> torch.Tensor:
        tokens = self.tokenizer(
            [clean_prompt(prompt)],
            padding="max_length",
            max_length=self.max_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state[0].float()
        length = int(mask[0].sum())
        out = torch.zeros(self.max_len, self.dim)
        out[:length] = states[:length].cpu()
        return out


def clean_prompt(prompt: str) -> str:
    """Wan's text cleaning: HTML entities resolved, whitespace collapsed."""
    return " ".join(html.unescape(html.unescape(prompt)).split())


# Wan2.1's T5 encoder names -> transformers' UMT5EncoderModel names (per block ``blocks.N.``).
UMT5_BLOCK_KEYS = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}


def original_umt5_keys(key: str) -> str:
    """One key of Wan's T5 encoder file in transformers' naming (unknown keys unchanged)."""
    if key == "token_embedding.weight":
        return "shared.weight"
    if key == "norm.weight":
        return "encoder.final_layer_norm.weight"
    parts = key.split(".", 2)
    if parts[0] == "blocks" and len(parts) == 3 and parts[2] in UMT5_BLOCK_KEYS:
        return f"encoder.block.{parts[1]}.{UMT5_BLOCK_KEYS[parts[2]]}"
    return key


def fit_original_umt5(path: str | Path) -> tuple[dict[str, torch.Tensor], Any]:
    """Wan's umT5 file (memory-mapped) in transformers' names, and the ``UMT5EncoderModel``
    its shapes make, on the meta device; ``ValueError`` naming the keys that do not fit."""
    from transformers import UMT5EncoderModel

    raw = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(raw, dict):
        raise ValueError(f"text encoder {path}: not a state dict")
    state = {original_umt5_keys(k): v for k, v in raw.items()}
    with torch.device("meta"):
        model = UMT5EncoderModel(umt5_config(state))
    expected = set(model.state_dict())
    # The input embedding is tied to ``shared``: the file holds it once.
    raise_unless_fits(f"text encoder {path}", expected - {"encoder.embed_tokens.weight"}, state)
    return state, model


def raise_unless_fits(what: str, expected: set[str], got: dict[str, Any]) -> None:
    """``ValueError`` naming the missing and unexpected keys, if any."""
    missing, unexpected = sorted(expected - set(got)), sorted(set(got) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{what}: {len(missing)} missing keys (e.g. {missing[:3]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )


def umt5_config(state: dict[str, torch.Tensor]) -> Any:
    """A ``UMT5Config`` for an encoder's weights (transformers' names), as umT5-XXL's own config
    would give it: gated GELU, relative position buckets per layer."""
    from transformers import UMT5Config

    try:
        vocab, d_model = state["shared.weight"].shape
        layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.block."))
        attention = "encoder.block.0.layer.0.SelfAttention"
        buckets, heads = state[f"{attention}.relative_attention_bias.weight"].shape
        inner = state[f"{attention}.q.weight"].shape[0]
        d_ff = state["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"the text encoder's weights lack umT5's {exc}") from None
    return UMT5Config(
        vocab_size=int(vocab),
        d_model=int(d_model),
        d_kv=int(inner) // int(heads),
        d_ff=int(d_ff),
        num_layers=layers,
        num_heads=int(heads),
        relative_attention_num_buckets=int(buckets),
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
    )


def make_text_encoder(kind: str, dim: int, max_len: int) -> TextEncoder:
    """The stand-in: ``hash`` (the only kind that needs no model folder; umT5 comes from a
    folder, ``load.load_text_encoder``)."""
    if kind == "hash":
        return HashingTextEncoder(dim, max_len)
    raise ValueError(
        f"unknown text encoder {kind!r}; the stand-in is 'hash', umT5 comes from "
        "a model folder (TURBOSERVE_MODEL)"
    )

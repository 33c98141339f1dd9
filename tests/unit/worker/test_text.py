from __future__ import annotations

import pytest
import torch

from services.gpu_worker.model.text import (
    HashingTextEncoder,
    ProjectedEncoder,
    make_text_encoder,
    minilm_available,
)


def test_hashing_encoder_is_deterministic_across_instances():
    a = HashingTextEncoder(dim=32, max_len=8).encode("A red fox, running.")
    b = HashingTextEncoder(dim=32, max_len=8).encode("a red fox , running .")
    assert a.shape == (8, 32) and a.dtype == torch.float32
    assert torch.equal(a, b)  # case and spacing do not matter; words and punctuation do


def test_hashing_encoder_distinguishes_prompts_and_order():
    enc = HashingTextEncoder(dim=32, max_len=8)
    base = enc.encode("red fox")
    assert not torch.equal(base, enc.encode("blue fox"))
    assert not torch.equal(base, enc.encode("fox red"))


def test_padding_is_zero_and_long_prompts_are_cut():
    enc = HashingTextEncoder(dim=16, max_len=4)
    short = enc.encode("one two")
    assert short[2:].abs().sum() == 0 and short[:2].abs().sum() > 0
    long = enc.encode("one two three four five six")
    assert torch.equal(long, enc.encode("one two three four"))


def test_projection_to_the_model_width_is_fixed():
    inner = HashingTextEncoder(dim=16, max_len=4)
    a, b = ProjectedEncoder(inner, 48), ProjectedEncoder(HashingTextEncoder(16, 4), 48)
    assert a.dim == 48 and a.encode("x y").shape == (4, 48)
    assert torch.equal(a.encode("x y"), b.encode("x y"))


def test_factory():
    assert make_text_encoder("hash", 32, 8).name == "hash"
    with pytest.raises(ValueError, match="unknown text encoder"):
        make_text_encoder("t5", 32, 8)
    auto = make_text_encoder("auto", 32, 8)
    assert auto.name.startswith("minilm" if minilm_available() else "hash")

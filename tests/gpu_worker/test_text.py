from __future__ import annotations

import pytest
import torch

from services.gpu_worker.model.text import (
    HashingTextEncoder,
    UMT5TextEncoder,
    clean_prompt,
    make_text_encoder,
)
from tests.models import build_text_encoder, build_tokenizer, umt5_to_original


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


def test_factory_knows_only_the_stand_in():
    assert make_text_encoder("hash", 32, 8).name == "hash"
    with pytest.raises(ValueError, match="model folder"):
        make_text_encoder("umt5", 32, 8)


@pytest.fixture(scope="module")
def tiny_umt5(tmp_path_factory):
    root = tmp_path_factory.mktemp("umt5")
    build_tokenizer(root / "tokenizer")
    model = build_text_encoder(seed=3)
    model.save_pretrained(str(root / "text_encoder"))
    torch.save(umt5_to_original(model.state_dict()), root / "umt5-enc.pth")
    return root, model


def _reference(root, model, prompt: str, max_len: int) -> torch.Tensor:
    """What diffusers' Wan pipeline does with transformers' own classes: tokenize to max_len,
    run the encoder, keep the prompt's rows, pad with zeros."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    tokens = tokenizer(
        [clean_prompt(prompt)],
        padding="max_length",
        max_length=max_len,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        states = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
    length = int(tokens.attention_mask.sum())
    out = torch.zeros(max_len, model.config.d_model)
    out[:length] = states.last_hidden_state[0, :length]
    return out


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_umt5_path_equals_transformers_own_encoder(tiny_umt5, layout):
    root, model = tiny_umt5
    cpu = torch.device("cpu")
    if layout == "diffusers":
        ours = UMT5TextEncoder.from_folders(
            root / "text_encoder", root / "tokenizer", cpu, torch.float32, max_len=32
        )
    else:
        ours = UMT5TextEncoder.from_original(
            root / "umt5-enc.pth", root / "tokenizer", cpu, torch.float32, max_len=32
        )
    assert ours.dim == 24
    for prompt in ["a red fox running through snow", "a  wolf &amp; the   night"]:
        got = ours.encode(prompt)
        expected = _reference(root, model, prompt, 32)
        assert got.shape == (32, 24)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        length = int((got.abs().sum(dim=1) > 0).sum())
        assert 0 < length < 32 and got[length:].abs().sum() == 0  # padding rows are zero
    assert not torch.equal(ours.encode("a red fox"), ours.encode("a blue whale"))
    assert ours.stream(cpu) is None  # on the CPU, no stream: it runs as it always did


def test_original_umt5_with_a_wrong_key_is_one_clear_error(tiny_umt5, tmp_path):
    root, model = tiny_umt5
    state = umt5_to_original(model.state_dict())
    state["blocks.1.attn.oo.weight"] = state.pop("blocks.1.attn.o.weight")
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match=r"text encoder .*bad.pth: 1 missing keys .*1 unexpected"):
        UMT5TextEncoder.from_original(
            tmp_path / "bad.pth", root / "tokenizer", torch.device("cpu"), torch.float32, max_len=8
        )

"""Prompts are encoded off the generation pass: a slow encoder (umT5 on a busy GPU) never
stalls the other sessions' passes; the embedding is taken at a chunk boundary once it is there.
The encoder here is the real hashing one behind a gate the test opens."""

from __future__ import annotations

import threading

import torch

from services.gpu_worker.engine.prompts import PromptEncoder
from services.gpu_worker.model.text import HashingTextEncoder

from .conftest import make_engine


class GatedEncoder:
    """The hashing encoder, but each encode waits until the test opens the gate (an encoder
    that takes as long as the test wants)."""

    name = "gated"

    def __init__(self, inner: HashingTextEncoder) -> None:
        self.inner, self.dim, self.max_len = inner, inner.dim, inner.max_len
        self.gate = threading.Event()
        self.calls: list[str] = []

    def encode(self, prompt: str) -> torch.Tensor:
        self.calls.append(prompt)
        assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.encode(prompt)


def _gated_engine():
    engine = make_engine()
    gated = GatedEncoder(engine.text_encoder)
    engine.prompts = PromptEncoder(gated)
    return engine, gated


def test_a_prompt_change_waits_for_its_encoding_without_stalling_the_pass():
    engine, gated = _gated_engine()
    gated.gate.set()
    engine.add_session("a", "a red fox", 1)
    engine.add_session("b", "a wolf at night", 2)
    engine.prompts.get("a wolf at night")  # both encoded before the gate closes
    for _ in range(engine.passes_per_chunk):
        engine.pass_step()
    gated.gate.clear()
    engine.set_prompt("a", "a blue whale")  # encoding starts, and blocks, on its own thread
    done = []
    for _ in range(2 * engine.passes_per_chunk):  # two chunk boundaries go by meanwhile
        done += engine.pass_step()
    assert sorted(r.session_id for r in done) == ["a", "a", "b", "b"]
    assert engine._sessions["a"].pending_prompt == "a blue whale"  # not applied yet
    assert engine._sessions["a"].prompt == "a red fox"
    gated.gate.set()
    engine.prompts.get("a blue whale")  # the encoding finishes
    for _ in range(engine.passes_per_chunk):
        engine.pass_step()
    assert engine._sessions["a"].prompt == "a blue whale"
    assert engine.prompt_switch_ms() is not None and engine.prompt_switch_ms() > 0
    assert gated.calls.count("a blue whale") == 1  # encoded once, then cached


def test_a_new_session_waits_out_of_the_batch_for_its_first_prompt():
    engine, gated = _gated_engine()
    gated.gate.set()
    engine.add_session("a", "a red fox", 1)
    engine.prompts.get("a red fox")
    gated.gate.clear()
    engine.add_session("new", "a storm at sea", 2)
    done = []
    for _ in range(2 * engine.passes_per_chunk):
        done += engine.pass_step()
    assert [r.session_id for r in done] == ["a", "a"]  # "a" kept its pace
    gated.gate.set()
    engine.prompts.get("a storm at sea")
    for _ in range(engine.passes_per_chunk):
        done += engine.pass_step()
    assert ("new", 0) in [(r.session_id, r.seq) for r in done]


def test_the_cache_keeps_embeddings_without_their_padding():
    encoder = PromptEncoder(HashingTextEncoder(dim=8, max_len=16), cache_size=2)
    first = encoder.get("one two three")
    assert first.shape == (16, 8) and first[3:].abs().sum() == 0
    assert encoder._cache["one two three"].shape == (3, 8)
    assert torch.equal(encoder.get("one two three"), first)
    encoder.get("four")
    encoder.get("five")
    assert "one two three" not in encoder._cache  # least recently used goes first

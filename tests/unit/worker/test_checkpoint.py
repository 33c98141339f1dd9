"""The loader reads the public Wan2.1 / Self-Forcing layout; the key list below is written from
that layout (not from our module names) so a renamed module breaks the test."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from services.gpu_worker.model import CheckpointMismatch, build_model, get_preset, load_checkpoint

from .conftest import make_engine


def wan_layout(config) -> dict[str, tuple[int, ...]]:
    dim, ffn = config.dim, config.ffn_dim
    shapes = {
        "patch_embedding.weight": (dim, 16, 1, 2, 2),
        "patch_embedding.bias": (dim,),
        "text_embedding.0.weight": (dim, config.text_dim),
        "text_embedding.0.bias": (dim,),
        "text_embedding.2.weight": (dim, dim),
        "text_embedding.2.bias": (dim,),
        "time_embedding.0.weight": (dim, config.freq_dim),
        "time_embedding.0.bias": (dim,),
        "time_embedding.2.weight": (dim, dim),
        "time_embedding.2.bias": (dim,),
        "time_projection.1.weight": (6 * dim, dim),
        "time_projection.1.bias": (6 * dim,),
        "head.head.weight": (16 * 4, dim),
        "head.head.bias": (16 * 4,),
        "head.modulation": (1, 2, dim),
    }
    for n in range(config.num_layers):
        block = f"blocks.{n}."
        for attn in ("self_attn", "cross_attn"):
            for proj in "qkvo":
                shapes[f"{block}{attn}.{proj}.weight"] = (dim, dim)
                shapes[f"{block}{attn}.{proj}.bias"] = (dim,)
            shapes[f"{block}{attn}.norm_q.weight"] = (dim,)
            shapes[f"{block}{attn}.norm_k.weight"] = (dim,)
        shapes[f"{block}norm3.weight"] = (dim,)
        shapes[f"{block}norm3.bias"] = (dim,)
        shapes[f"{block}ffn.0.weight"] = (ffn, dim)
        shapes[f"{block}ffn.0.bias"] = (ffn,)
        shapes[f"{block}ffn.2.weight"] = (dim, ffn)
        shapes[f"{block}ffn.2.bias"] = (dim,)
        shapes[f"{block}modulation"] = (1, 6, dim)
    return shapes


def write_checkpoint(path, config, prefix="model.", dtype=torch.bfloat16, drop=(), extra=None):
    generator = torch.Generator().manual_seed(123)
    tensors = {
        prefix + key: (torch.randn(shape, generator=generator) * 0.05).to(dtype)
        for key, shape in wan_layout(config).items()
        if key not in drop
    }
    tensors.update(extra or {})
    save_file(tensors, str(path))
    return tensors


@pytest.mark.parametrize("prefix", ["", "model.", "generator_ema.model.", "diffusion_model."])
def test_load_wan_layout_roundtrip(tmp_path, prefix):
    config = get_preset("tiny")
    path = tmp_path / "ckpt.safetensors"
    written = write_checkpoint(path, config, prefix=prefix)
    model = build_model(config, seed=99)
    load_checkpoint(model, path)
    params = dict(model.named_parameters())
    assert set(params) == set(wan_layout(config))
    for key, tensor in written.items():
        assert torch.equal(params[key.removeprefix(prefix)], tensor.float())


def test_mismatches_are_named(tmp_path):
    config = get_preset("tiny")
    path = tmp_path / "bad.safetensors"
    write_checkpoint(
        path, config, drop={"head.modulation"},
        extra={"model.img_emb.proj.0.weight": torch.zeros(3)},
    )
    with pytest.raises(CheckpointMismatch) as err:
        load_checkpoint(build_model(config), path)
    assert err.value.missing == ["head.modulation"]
    assert err.value.unexpected == ["img_emb.proj.0.weight"]
    unused = load_checkpoint(build_model(config), path, strict=False)
    assert unused == ["img_emb.proj.0.weight"]


def test_misshapen_weights_are_refused_even_when_not_strict(tmp_path):
    config = get_preset("tiny")
    path = tmp_path / "shape.safetensors"
    write_checkpoint(path, config, drop={"head.head.bias"},
                     extra={"model.head.head.bias": torch.zeros(5)})
    with pytest.raises(CheckpointMismatch) as err:
        load_checkpoint(build_model(config), path, strict=False)
    assert err.value.misshapen and "head.head.bias" in err.value.misshapen[0]


def test_engine_generates_from_a_checkpoint(tmp_path):
    config = get_preset("tiny")
    path = tmp_path / "ckpt.safetensors"
    write_checkpoint(path, config)
    loaded = [make_engine(checkpoint=str(path), seed=s) for s in (0, 1)]
    random_weights = make_engine(seed=0)
    frames = []
    for engine in [*loaded, random_weights]:
        engine.add_session("s", "a lake", 1)
        frames.append(engine.step()[0].frames)
    # The checkpoint, not the weight seed, decides the DiT; the decoder is still seeded.
    assert not torch.equal(frames[0], frames[2])
    assert torch.equal(loaded[0].model.blocks[0].ffn[0].weight, loaded[1].model.blocks[0].ffn[0].weight)

"""The loader reads the public Wan2.1 / Self-Forcing layout; the key list below is written from
that layout (not from our module names) so a renamed module breaks the test."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from services.gpu_worker.engine import next_chunks
from services.gpu_worker.model import (
    CheckpointMismatch,
    build_model,
    get_preset,
    load_checkpoint,
    read_checkpoint,
)

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
        path,
        config,
        drop={"head.modulation"},
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
    write_checkpoint(
        path, config, drop={"head.head.bias"}, extra={"model.head.head.bias": torch.zeros(5)}
    )
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
        frames.append(next_chunks(engine)[0].frames)
    # The checkpoint, not the weight seed, decides the DiT; the decoder is still seeded.
    assert not torch.equal(frames[0], frames[2])
    assert torch.equal(
        loaded[0].model.blocks[0].ffn[0].weight, loaded[1].model.blocks[0].ffn[0].weight
    )


def test_a_self_forcing_pt_is_read_directly_with_its_generator_ema(tmp_path):
    """Self-Forcing's training checkpoints: a dict of state dicts, ``generator_ema`` wins;
    read with ``weights_only=True``, so a pickle that runs code is refused."""
    config = get_preset("tiny")
    ema = {k: torch.randn(shape) for k, shape in wan_layout(config).items()}
    plain = {k: torch.zeros(shape) for k, shape in wan_layout(config).items()}
    path = tmp_path / "self_forcing_dmd.pt"
    torch.save(
        {
            "generator": plain,
            "generator_ema": {f"model.{k}": v for k, v in ema.items()},
            "step": torch.tensor(600),
        },
        path,
    )
    tensors = read_checkpoint(path)
    assert set(tensors) == set(ema) and all(torch.equal(tensors[k], ema[k]) for k in ema)

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"generator_ema": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="(?i)weights.only|unsupported|global"):
        read_checkpoint(tmp_path / "evil.pt")


def test_lora_pairs_are_merged_into_their_base_weights(tmp_path):
    config = get_preset("tiny")
    base = {k: torch.randn(shape) for k, shape in wan_layout(config).items()}
    down, up = torch.randn(4, config.dim), torch.randn(config.dim, 4)
    peft = {
        f"base_model.model.{k}".replace(".q.weight", ".q.base_layer.weight"): v
        for k, v in base.items()
    }
    peft["base_model.model.blocks.0.self_attn.q.lora_A.default.weight"] = down
    peft["base_model.model.blocks.0.self_attn.q.lora_B.default.weight"] = up
    save_file({k: v.contiguous() for k, v in peft.items()}, str(tmp_path / "longlive.safetensors"))
    tensors = read_checkpoint(tmp_path / "longlive.safetensors")
    assert set(tensors) == set(base)
    merged = tensors["blocks.0.self_attn.q.weight"]
    torch.testing.assert_close(merged, base["blocks.0.self_attn.q.weight"] + up @ down)
    assert torch.equal(tensors["blocks.1.self_attn.q.weight"], base["blocks.1.self_attn.q.weight"])


def test_an_unknown_file_is_one_clear_error(tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"model.ckpt: unknown format '.ckpt'"):
        read_checkpoint(tmp_path / "model.ckpt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a state dict of tensors"):
        read_checkpoint(tmp_path / "list.pt")


def test_geometry_comes_from_the_checkpoint_not_the_preset(tmp_path):
    """A checkpoint wider than the preset runs at its own width (the heads from the preset
    only when the widths agree; else Wan's head width of 128)."""
    config = get_preset("tiny")
    wider = dataclasses.replace(config, dim=128, ffn_dim=96, num_heads=1, num_layers=3)
    path = tmp_path / "wide.safetensors"
    write_checkpoint(path, wider)
    engine = make_engine(checkpoint=str(path))
    assert (
        engine.model_config.dim,
        engine.model_config.num_layers,
        engine.model_config.ffn_dim,
        engine.model_config.num_heads,
    ) == (128, 3, 96, 1)
    engine.add_session("s", "a lake", 1)
    assert next_chunks(engine)[0].frames.shape == (12, config.height, config.width, 3)


def test_the_kv_recache_is_on_for_longlive_and_off_for_other_checkpoints(tmp_path):
    config = get_preset("tiny")
    write_checkpoint(tmp_path / "self_forcing.safetensors", config)
    write_checkpoint(tmp_path / "longlive_base.safetensors", config)
    lora = {k: v for k, v in write_checkpoint(tmp_path / "x.safetensors", config).items()}
    lora["model.blocks.0.ffn.0.lora_A.weight"] = torch.zeros(2, config.dim, dtype=torch.bfloat16)
    lora["model.blocks.0.ffn.0.lora_B.weight"] = torch.zeros(
        config.ffn_dim, 2, dtype=torch.bfloat16
    )
    save_file(lora, str(tmp_path / "adapter_merged.safetensors"))
    recache = {
        name: make_engine(checkpoint=str(tmp_path / name)).prompt_recache
        for name in (
            "self_forcing.safetensors",
            "longlive_base.safetensors",
            "adapter_merged.safetensors",
        )
    }
    assert recache == {
        "self_forcing.safetensors": "cross",
        "longlive_base.safetensors": "kv",
        "adapter_merged.safetensors": "kv",
    }
    assert make_engine().prompt_recache == "kv"  # the stand-in, as before
    assert (
        make_engine(
            checkpoint=str(tmp_path / "self_forcing.safetensors"), prompt_recache="kv"
        ).prompt_recache
        == "kv"
    )

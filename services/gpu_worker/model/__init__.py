"""The streaming video model: causal Wan-style DiT, frame decoders (the stand-in and the Wan
VAE), text encoders (the stand-in and umT5), and what loads them (``load.py``)."""

from .checkpoint import CheckpointMismatch, load_checkpoint, read_checkpoint
from .config import PRESETS, ModelConfig, get_preset
from .decoder import LatentDecoder, build_decoder
from .dit import CausalWanModel, ChunkCaches, build_model
from .text import HashingTextEncoder, TextEncoder, make_text_encoder

__all__ = [
    "PRESETS",
    "CausalWanModel",
    "CheckpointMismatch",
    "ChunkCaches",
    "HashingTextEncoder",
    "LatentDecoder",
    "ModelConfig",
    "TextEncoder",
    "build_decoder",
    "build_model",
    "get_preset",
    "load_checkpoint",
    "read_checkpoint",
    "make_text_encoder",
]

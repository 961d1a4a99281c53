"""Llama (`llama`: Llama 2, 3, 3.1, 3.2, TinyLlama, SmolLM and the embedded `stdlib-llama`): pre-RMSNorm blocks,
grouped-query attention with rotary positions (Llama 3's scaled rotary included), a SwiGLU MLP. Its reader, writer,
layout and preset builder are the Llama-like ones most families start from (`readers.llama_like`)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA
from .presets import llama_preset, named_presets
from .readers import llama_like


def read(r: ConfigReader) -> dict[str, Any]:
    bias = r.bool("attention_bias", False)
    return llama_like(r, bias, bias, r.bool("mlp_bias", False), eps=1e-6, bos=1, eos=2, must_divide=True)


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "mlp_bias": cfg.mlp_bias}


LAYOUT = LLAMA

LLAMA3_FIELDS = dict(rope_type="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_n_ctx=8192,
                     norm_eps=1e-5)

PRESETS = named_presets(
    llama_preset("llama-3.2-1b", "llama", 16, 2048, 32, 8, 8192, 128256, 131072, True, 500000.0, rope_factor=32.0, **LLAMA3_FIELDS),
    llama_preset("llama-3.2-3b", "llama", 28, 3072, 24, 8, 8192, 128256, 131072, True, 500000.0, rope_factor=32.0, **LLAMA3_FIELDS),
    llama_preset("llama-3.1-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 131072, False, 500000.0, rope_factor=8.0,
                 **LLAMA3_FIELDS))

# GQA and Llama 3's rotary scaling
TINY = dict(TINY_SHAPE, num_key_value_heads=2, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=16))

FAMILY = Family("llama", "LlamaForCausalLM", "LlamaConfig",
                "Llama 2, 3, 3.1, 3.2, TinyLlama, SmolLM, the embedded `stdlib-llama`", read, write, LAYOUT, PRESETS, TINY)

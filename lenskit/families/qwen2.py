"""Qwen 2 and 2.5 (`qwen2`): Llama's block with biases on q, k and v."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA
from .presets import llama_preset, named_presets
from .readers import llama_like, no_qwen_sliding


def read(r: ConfigReader) -> dict[str, Any]:
    no_qwen_sliding(r)
    return llama_like(r, True, False, False, eps=1e-6, bos=None, eos=None, kv_heads=32)


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg, head_dim=False), "use_sliding_window": False}


LAYOUT = LLAMA

PRESETS = named_presets(
    llama_preset("qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 4864, 151936, 32768, True, 1000000.0, qkv_bias=True),
    llama_preset("qwen2.5-1.5b", "qwen2", 28, 1536, 12, 2, 8960, 151936, 32768, True, 1000000.0, qkv_bias=True),
    llama_preset("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, 131072, False, 1000000.0, qkv_bias=True))

TINY = dict(TINY_SHAPE, num_key_value_heads=2)  # q/k/v biases are the family's

FAMILY = Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "Qwen 2, 2.5", read, write, LAYOUT, PRESETS, TINY)

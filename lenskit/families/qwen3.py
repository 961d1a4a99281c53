"""Qwen 3 (`qwen3`, dense): Llama's block with per-head q/k RMSNorms and heads of 128 whatever d_model is."""

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
    bias = r.bool("attention_bias", False)
    return {**llama_like(r, bias, bias, False, eps=1e-6, bos=None, eos=None, kv_heads=32, head_dim=128,
                         null_head_dim=False), "qk_norm": True}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "use_sliding_window": False}


LAYOUT = LLAMA


def _qwen3(name: str, n_layers: int, d_model: int, n_heads: int, d_mlp: int, tied: bool) -> ModelConfig:
    return llama_preset(name, "qwen3", n_layers, d_model, n_heads, 8, d_mlp, 151936, 40960, tied, 1000000.0, d_head=128,
                        qk_norm=True)


PRESETS = named_presets(_qwen3("qwen3-0.6b", 28, 1024, 16, 3072, True), _qwen3("qwen3-1.7b", 28, 2048, 16, 6144, True),
                        _qwen3("qwen3-4b", 36, 2560, 32, 9728, True), _qwen3("qwen3-8b", 36, 4096, 32, 12288, False))

# q/k norms and a d_head that is not d_model / n_heads
TINY = dict(TINY_SHAPE, num_key_value_heads=2, head_dim=16)

FAMILY = Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "Qwen 3", read, write, LAYOUT, PRESETS, TINY)

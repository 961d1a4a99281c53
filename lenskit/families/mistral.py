"""Mistral (`mistral`, Mistral 7B): Llama's block with a sliding attention window."""

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
    # A null sliding_window is no window (Mistral 7B v0.2 on); an absent one is transformers' 4096.
    return {**llama_like(r, False, False, False, eps=1e-6, bos=1, eos=2, kv_heads=8, null_kv_heads=False),
            "sliding_window": r.int("sliding_window", 4096, null=None)}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "sliding_window": cfg.sliding_window}


LAYOUT = LLAMA

PRESETS = named_presets(llama_preset("mistral-7b", "mistral", 32, 4096, 32, 8, 14336, 32000, 32768, False, 10000.0,
                                     sliding_window=4096, norm_eps=1e-5))

# a sliding window shorter than the test prompts
TINY = dict(TINY_SHAPE, num_key_value_heads=2, sliding_window=5, head_dim=8)

FAMILY = Family("mistral", "MistralForCausalLM", "MistralConfig", "Mistral 7B", read, write, LAYOUT, PRESETS, TINY)

"""Phi-3 (`phi3`, 4k context) and Phi-4: Llama's block with q/k/v fused in one projection, and gate and up in another."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, Layout
from .presets import llama_preset, named_presets
from .readers import llama_like


def read(r: ConfigReader) -> dict[str, Any]:
    r.int("original_max_position_embeddings", 4096)  # typed only: it matters to longrope scaling, which is refused
    # transformers 5's Phi-3 accepts only plain and longrope rotary; lenskit implements the plain one
    return {**llama_like(r, False, False, False, eps=1e-5, bos=1, eos=32000, rope_types=("default",)),
            "fused_qkv": True, "mlp": "swiglu_fused", "sliding_window": r.int("sliding_window", None)}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg, head_dim=False), "sliding_window": cfg.sliding_window}


LAYOUT = Layout(
    prefix="model.", blocks="layers", top=LLAMA.top,
    block={**LLAMA_BLOCK, "attn.qkv.weight": "self_attn.qkv_proj.weight", "mlp.gate_up.weight": "mlp.gate_up_proj.weight"},
)

# Phi-4 (14B; Phi-4-reasoning has its shape) is a `phi3` model: grouped-query, no window, base 2.5e5, 16k context.
# Phi-4-mini's LongRoPE is refused by the reader.
PRESETS = named_presets(
    llama_preset("phi-3-mini", "phi3", 32, 3072, 32, 32, 8192, 32064, 4096, False, 10000.0, fused_qkv=True,
                 mlp="swiglu_fused", sliding_window=2047, bos_token_id=1, eos_token_id=32000, norm_eps=1e-5),
    llama_preset("phi-4", "phi3", 40, 5120, 40, 10, 17920, 100352, 16384, False, 250000.0, fused_qkv=True,
                 mlp="swiglu_fused", bos_token_id=100257, eos_token_id=100265, norm_eps=1e-5))

TINY = dict(TINY_SHAPE, num_key_value_heads=2, sliding_window=6, pad_token_id=0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))

FAMILY = Family("phi3", "Phi3ForCausalLM", "Phi3Config", "Phi-3 (4k context), Phi-4", read, write, LAYOUT, PRESETS, TINY)

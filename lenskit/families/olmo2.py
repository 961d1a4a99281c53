"""OLMo 2 (`olmo2`): Llama's projections with post-norms only (each sublayer's output is normed before the residual
add) and q/k RMSNorms over the whole projection, not per head."""

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
    bias = r.bool("attention_bias", False)
    return {**llama_like(r, bias, bias, False, eps=1e-5, bos=None, eos=50279), "qk_norm": True, "qk_norm_per_head": False,
            "norm_placement": "post"}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg, head_dim=False), "attention_bias": cfg.attention.qkv_bias}


LAYOUT = Layout(  # post-norms only: transformers' post_attention_layernorm follows attention, as our ln1_post does
    prefix="model.", blocks="layers", top=LLAMA.top,
    block={**LLAMA_BLOCK, "ln1_post.weight": "post_attention_layernorm.weight",
           "ln2_post.weight": "post_feedforward_layernorm.weight"},
)

OLMO2_FIELDS = dict(qk_norm=True, qk_norm_per_head=False, norm_placement="post", norm_eps=1e-6, bos_token_id=None,
                    eos_token_id=100257)

PRESETS = named_presets(
    llama_preset("olmo-2-1b", "olmo2", 16, 2048, 16, 16, 8192, 100352, 4096, False, 500000.0, **OLMO2_FIELDS),
    llama_preset("olmo-2-7b", "olmo2", 32, 4096, 32, 32, 11008, 100352, 4096, False, 500000.0, **OLMO2_FIELDS))

TINY = dict(TINY_SHAPE, num_key_value_heads=2, pad_token_id=0)

FAMILY = Family("olmo2", "Olmo2ForCausalLM", "Olmo2Config", "OLMo 2", read, write, LAYOUT, PRESETS, TINY)

"""OLMo 3 (`olmo3`): OLMo 2's block (`olmo2`) with sliding-window blocks (three in four by default) and rotary
settings per layer type (YaRN on the full blocks only)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .olmo2 import LAYOUT, OLMO2_FIELDS
from .presets import llama_preset, named_presets
from .readers import llama_like, sliding_windows
from .rope import olmo3_rope


def read(r: ConfigReader) -> dict[str, Any]:
    """OLMo 2's block with sliding-window blocks (three in four by default) and rotary settings per layer type."""
    bias = r.bool("attention_bias", False)
    fields = llama_like(r, bias, bias, False, eps=1e-5, bos=None, eos=50279, rotary=olmo3_rope)
    return {**fields, **sliding_windows(r, fields["n_layers"], 4, 4096), "qk_norm": True, "qk_norm_per_head": False,
            "norm_placement": "post"}


def write(cfg: ModelConfig) -> dict[str, Any]:
    local = cfg.rope.base if cfg.rope.local_base is None else cfg.rope.local_base
    return {**writers.llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "sliding_window": cfg.sliding_window,
            "layer_types": writers.hf_layer_types(cfg),
            "rope_parameters": {"sliding_attention": writers.rope_parameters(cfg, base=local, scaled=False),
                                "full_attention": writers.rope_parameters(cfg)}}


def _olmo3(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int) -> ModelConfig:
    """OLMo 3: OLMo 2's block, three sliding-window blocks (window 4096) to one full, YaRN (x8 over 8192 tokens) on the
    full blocks only. Shapes from the published config.json files (allenai/Olmo-3-1025-7B, allenai/Olmo-3-1125-32B),
    written from memory, not downloaded; the window, pattern and base agree with Olmo3Config's defaults."""
    return llama_preset(name, "olmo3", n_layers, d_model, n_heads, n_kv_heads, d_mlp, 100278, 65536, False, 500000.0,
                        **OLMO2_FIELDS, rope_type="yarn", rope_factor=8.0, rope_original_n_ctx=8192,
                        rope_attention_factor=1.2079441541679836, local_rotary_base=500000.0, sliding_window=4096,
                        layer_types=tuple("full" if (i + 1) % 4 == 0 else "sliding" for i in range(n_layers)))


PRESETS = named_presets(_olmo3("olmo-3-7b", 32, 4096, 32, 32, 11008), _olmo3("olmo-3-32b", 64, 5120, 40, 8, 27648))

# a sliding block (window shorter than the prompt, its own base) and a full one with YaRN (x4 over 16 tokens)
TINY = dict(TINY_SHAPE, num_key_value_heads=2, pad_token_id=0, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                             "full_attention": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                    original_max_position_embeddings=16)})

FAMILY = Family("olmo3", "Olmo3ForCausalLM", "Olmo3Config", "OLMo 3", read, write, LAYOUT, PRESETS, TINY,
                tiny_3_blocks=dict(num_hidden_layers=3,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]))

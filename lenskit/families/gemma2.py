"""Gemma 2 (`gemma2`): (1 + w) RMSNorms before and after each sublayer, a scaled embedding, a GELU-gated MLP,
`query_pre_attn_scalar`, every other block sliding-window, soft-capped attention scores and logits. Its reader,
writer and preset builder are the Gemma-like ones Gemma 3 shares (`readers.gemma_like`)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import GEMMA
from .presets import gemma_preset, named_presets
from .readers import gemma_like, soft_cap
from .rope import rope


def read(r: ConfigReader) -> dict[str, Any]:
    fields = gemma_like(r, pattern=2)
    return {**fields, **rope(r, fields["d_head"]),
            "attn_softcap": soft_cap(r, "attn_logit_softcapping", 50.0),
            "final_softcap": soft_cap(r, "final_logit_softcapping", 30.0)}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.gemma_like(cfg), "rope_parameters": writers.rope_parameters(cfg),
            "attn_logit_softcapping": cfg.attention.softcap}


LAYOUT = GEMMA

GEMMA2_FIELDS = dict(attn_softcap=50.0, final_softcap=30.0)

PRESETS = named_presets(
    gemma_preset("gemma-2-2b", "gemma2", 26, 2304, 8, 4, 9216, 256000, 8192, 4096, 2, **GEMMA2_FIELDS),
    gemma_preset("gemma-2-9b", "gemma2", 42, 3584, 16, 8, 14336, 256000, 8192, 4096, 2, **GEMMA2_FIELDS))

# Gemma: weights 10x larger than usual so that soft-caps this small bite (test_families checks they do), a
# query_pre_attn_scalar that is not d_head, one sliding block (window shorter than the prompt) and one global.
GEMMA_TINY = dict(TINY_SHAPE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                  initializer_range=0.2, final_logit_softcapping=2.0, pad_token_id=0)

TINY = dict(GEMMA_TINY, attn_logit_softcapping=1.0)

FAMILY = Family("gemma2", "Gemma2ForCausalLM", "Gemma2Config", "Gemma 2", read, write, LAYOUT, PRESETS, TINY)

"""Gemma 3's text model (`gemma3_text`: 1B, or the text part of 4B and up): Gemma 2's block (`readers.gemma_like`)
with q/k norms, one global block in six, rotary settings per layer type and no attention soft-cap."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import Family
from .fields import ConfigReader
from .gemma2 import GEMMA_TINY
from .layouts import GEMMA
from .presets import gemma_preset, named_presets
from .readers import gemma_like, soft_cap
from .rope import gemma3_rope


def read(r: ConfigReader) -> dict[str, Any]:
    # transformers' Gemma 3 attention stores attn_logit_softcapping but never applies it: refused rather than guessed.
    r.require("attn_logit_softcapping", (None,), None)
    fields = gemma_like(r, pattern=r.int("sliding_window_pattern", 6))
    return {**fields, **gemma3_rope(r, fields["d_head"]), "qk_norm": True,
            "final_softcap": soft_cap(r, "final_logit_softcapping", None)}


def write(cfg: ModelConfig) -> dict[str, Any]:
    local = cfg.rope.base if cfg.rope.local_base is None else cfg.rope.local_base
    return {**writers.gemma_like(cfg), "attn_logit_softcapping": None,
            "rope_parameters": {"sliding_attention": writers.rope_parameters(cfg, base=local, scaled=False),
                                "full_attention": writers.rope_parameters(cfg)}}


LAYOUT = GEMMA

GEMMA3_FIELDS = dict(qk_norm=True, rotary_base=1_000_000.0, local_rotary_base=10000.0)

PRESETS = named_presets(
    gemma_preset("gemma-3-1b", "gemma3_text", 26, 1152, 4, 1, 6912, 262144, 32768, 512, 6, **GEMMA3_FIELDS),
    gemma_preset("gemma-3-4b", "gemma3_text", 34, 2560, 8, 4, 10240, 262208, 131072, 1024, 6, **GEMMA3_FIELDS,
                 rope_type="linear", rope_factor=8.0))  # the text part of Gemma3ForConditionalGeneration

TINY = dict(GEMMA_TINY, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                             "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=10000.0)})

FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig",
                "Gemma 3 (text only: 1B, or the text part of 4B+)", read, write, LAYOUT, PRESETS, TINY,
                tiny_3_blocks=dict(num_hidden_layers=3,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]))

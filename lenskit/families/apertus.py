"""Apertus (`apertus`, Swiss AI's 8B and 70B): Llama's block with per-head q/k RMSNorms and an ungated MLP whose
activation is xIELU, with two learned scalars per block (`lenskit.pieces.mlp.XIELU`); Llama 3's scaled rotary."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, Layout
from .presets import llama_preset, named_presets
from .readers import llama_like

# transformers' ApertusConfig builds this rotary when config.json gives none
_ROPE = dict(rope_type="llama3", rope_theta=12_000_000.0, factor=8.0, original_max_position_embeddings=8192,
             low_freq_factor=1.0, high_freq_factor=4.0)


def read(r: ConfigReader) -> dict[str, Any]:
    bias = r.bool("attention_bias", False)
    return {**llama_like(r, bias, bias, False, eps=1e-5, bos=1, eos=2, null_head_dim=False, act="xielu",
                         default_theta=12_000_000.0, default_params=_ROPE),
            "qk_norm": True, "mlp": "gelu", "activation": "xielu"}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "hidden_act": "xielu", "attention_bias": cfg.attention.qkv_bias}


LAYOUT = Layout(  # its own norm names, and xIELU's scalars under the MLP's act_fn
    prefix="model.", blocks="layers", top=LLAMA.top, buffers=LLAMA.buffers,
    block={**LLAMA_BLOCK, "ln1.weight": "attention_layernorm.weight", "ln2.weight": "feedforward_layernorm.weight",
           **{f"mlp.act.{x}": f"mlp.act_fn.{x}" for x in ("alpha_p", "alpha_n", "beta", "eps")}},
)

APERTUS_FIELDS = dict(qk_norm=True, mlp="gelu", activation="xielu", mlp_bias=False, norm_eps=1e-5, rope_type="llama3", rope_factor=8.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_n_ctx=8192,
                      bos_token_id=1, eos_token_id=2)

PRESETS = named_presets(
    llama_preset("apertus-8b", "apertus", 32, 4096, 32, 8, 21504, 131072, 65536, False, 12_000_000.0, **APERTUS_FIELDS),
    llama_preset("apertus-70b", "apertus", 80, 8192, 64, 8, 43008, 131072, 65536, False, 12_000_000.0, **APERTUS_FIELDS))

# q/k norms, GQA, and Llama 3's rotary scaling, as the published configs have them
TINY = dict(TINY_SHAPE, num_key_value_heads=2, rope_parameters=dict(_ROPE, original_max_position_embeddings=16))

FAMILY = Family("apertus", "ApertusForCausalLM", "ApertusConfig", "Apertus", read, write, LAYOUT, PRESETS, TINY)

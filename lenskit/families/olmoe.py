"""OLMoE (`olmoe`): Llama's projections with q/k norms over the whole projection, and routed SwiGLU experts in every
block."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_MOE_SHAPE, Family
from .fields import ConfigReader
from .layouts import MOE
from .presets import llama_preset, named_presets
from .readers import llama_like, routed_experts


def read(r: ConfigReader) -> dict[str, Any]:
    r.require("clip_qkv", (None,), None)  # clamping q, k and v is not implemented
    r.require("sliding_window", (None,), None)
    bias = r.bool("attention_bias", False)
    fields = llama_like(r, bias, bias, False, eps=1e-5, bos=None, eos=50279)
    d_model, n_heads, d_head = fields["d_model"], fields["n_heads"], fields["d_head"]
    if d_head * n_heads != d_model:  # its q norm spans hidden_size features, its q projection heads * head_dim
        raise ValueError(f"config fields hidden_size={d_model}, num_attention_heads={n_heads} and head_dim={d_head}: "
                         "OLMoE's q norm spans hidden_size features, so num_attention_heads * head_dim must equal "
                         "hidden_size (transformers fails in its forward otherwise); fix config.json")
    return {**fields, "qk_norm": True, "qk_norm_per_head": False,
            **routed_experts(r, "num_experts", "num_local_experts", 64, 8, renorm=r.bool("norm_topk_prob", False))}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg, head_dim=False), "attention_bias": cfg.attention.qkv_bias, "clip_qkv": None,
            "norm_topk_prob": writers.norm_topk(cfg), **writers.routed_experts(cfg, "num_experts")}


LAYOUT = MOE

OLMOE_FIELDS = dict(qk_norm=True, qk_norm_per_head=False, norm_eps=1e-5, n_experts=64, n_experts_per_token=8,
                    routing="softmax_topk", bos_token_id=None, eos_token_id=50279)

PRESETS = named_presets(llama_preset("olmoe-1b-7b", "olmoe", 16, 2048, 16, 16, 1024, 50304, 4096, False, 10000.0,
                                     **OLMOE_FIELDS))

# its top-k weights renormalised (norm_topk_prob) and its q/k norms over the whole projection
TINY = dict(TINY_MOE_SHAPE, num_experts=4, norm_topk_prob=True, pad_token_id=0)

FAMILY = Family("olmoe", "OlmoeForCausalLM", "OlmoeConfig", "OLMoE", read, write, LAYOUT, PRESETS, TINY)

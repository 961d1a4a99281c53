"""Qwen 3 MoE (`qwen3_moe`): Qwen 3's attention (`qwen3`), and routed SwiGLU experts in every block but the dense ones
(`mlp_only_layers`, `decoder_sparse_step`)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_MOE_SHAPE, Family
from .fields import ConfigReader
from .layouts import MOE
from .presets import llama_preset, named_presets
from .readers import llama_like, no_qwen_sliding, qwen_dense_layers, routed_experts


def read(r: ConfigReader) -> dict[str, Any]:
    no_qwen_sliding(r)
    bias = r.bool("attention_bias", False)
    fields = llama_like(r, bias, bias, False, eps=1e-6, bos=None, eos=None, kv_heads=4, null_head_dim=False,
                        null_kv_heads=False)
    n = fields["n_layers"]
    experts = routed_experts(r, "num_experts", "num_local_experts", 128, 8, renorm=r.bool("norm_topk_prob", False))
    return {**fields, **experts, "qk_norm": True, "d_expert": r.int("moe_intermediate_size", 768),
            "dense_layers": qwen_dense_layers(r, n)}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "use_sliding_window": False,
            "moe_intermediate_size": cfg.moe.d_expert, "norm_topk_prob": writers.norm_topk(cfg), "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.moe.dense_layers), **writers.routed_experts(cfg, "num_experts")}


LAYOUT = MOE

QWEN3_MOE_FIELDS = dict(qk_norm=True, routing="softmax_topk_renorm", n_experts=128, n_experts_per_token=8)

PRESETS = named_presets(
    llama_preset("qwen3-30b-a3b", "qwen3_moe", 48, 2048, 32, 4, 6144, 151936, 40960, False, 1_000_000.0,
                 d_head=128, d_expert=768, **QWEN3_MOE_FIELDS),
    llama_preset("qwen3-235b-a22b", "qwen3_moe", 94, 4096, 64, 4, 12288, 151936, 40960, False, 1_000_000.0,
                 d_head=128, d_expert=1536, **QWEN3_MOE_FIELDS))

# a dense block (mlp_only_layers) and a narrower expert width than its dense MLP
TINY = dict(TINY_MOE_SHAPE, num_experts=4, head_dim=16, moe_intermediate_size=24, mlp_only_layers=[1])

FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen 3 MoE", read, write, LAYOUT, PRESETS, TINY)

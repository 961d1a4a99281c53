"""GLM-4.5 / 4.5-Air / 4.6 (`glm4_moe`): Llama's grouped-query attention with biased q/k/v projections, rotary
positions on the first half of each head's features (`partial_rotary_factor`, 0.5 by default) and, on request
(`use_qk_norm`), per-head q/k RMSNorms; after the first `first_k_dense_replace` dense blocks, DeepSeek V3's routed
experts with sigmoid scores, the correction bias, group-limited choice and shared experts
(lenskit.pieces.shared_experts). A published checkpoint's multi-token-prediction block (`layers.<n_layers>`) is left
unread, as transformers leaves it."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import Family
from .fields import ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, SHARED_EXPERTS_BLOCK, FusedExperts, Layout, past_the_blocks
from .presets import llama_preset, named_presets
from .readers import grouped_sigmoid_experts, llama_like


def read(r: ConfigReader) -> dict[str, Any]:
    bias = r.bool("attention_bias", False)
    # the output projection has no bias whatever attention_bias says
    fields = llama_like(r, bias, False, False, eps=1e-5, bos=None, eos=None, kv_heads=8, null_kv_heads=False,
                        default_fraction=0.5, default_theta=10000.0)
    if fields["rotary_dim"] % 2:  # transformers' own defaults (no head_dim: 4096 // 96 = 42, half of it rotated)
        raise ValueError(f"config fields head_dim={fields['d_head']} and partial_rotary_factor give an odd rotary width "
                         f"{fields['rotary_dim']}, which rotates in pairs (model_type={r.family!r}); give head_dim "
                         "(GLM-4.5's is 128)")
    experts = grouped_sigmoid_experts(r, fields["n_layers"], n=128, d_expert=1408, n_group=1, topk_group=1,
                                      first_dense=1, scaling=1.0)
    return {**fields, **experts, "qk_norm": r.bool("use_qk_norm", False)}


def write(cfg: ModelConfig) -> dict[str, Any]:
    # partial: transformers' default factor is 0.5, so a whole rotation is written as 1.0
    return {**writers.llama_like(cfg), "rope_parameters": writers.rope_parameters(cfg, partial=True),
            "attention_bias": cfg.attention.qkv_bias, "use_qk_norm": cfg.attention.qk_norm,
            **writers.grouped_sigmoid_experts(cfg)}


LAYOUT = Layout(prefix="model.", blocks="layers", top=LLAMA.top, block={**LLAMA_BLOCK, **SHARED_EXPERTS_BLOCK},
                buffers=LLAMA.buffers, fused=FusedExperts(), unread=past_the_blocks)


def _glm(name: str, n_layers: int, d_model: int, d_mlp: int, n_ctx: int, n_experts: int, d_expert: int, scaling: float,
         first_dense: int, qk_norm: bool) -> ModelConfig:
    """GLM-4.5's shape: 96 query heads of 128 over 8 kv heads, biased q/k/v, half of each head rotated at base 1e6,
    RMSNorm eps 1e-5, a 151552-token vocabulary, 8 of the routed experts per token in one group plus one shared one;
    the first `first_dense` blocks dense."""
    return llama_preset(
        name, "glm4_moe", n_layers, d_model, 96, 8, d_mlp, 151552, n_ctx, False, 1_000_000.0, d_head=128, rotary_dim=64,
        norm_eps=1e-5, qkv_bias=True, qk_norm=qk_norm, n_experts=n_experts, n_experts_per_token=8, d_expert=d_expert,
        routing="sigmoid_group_topk_renorm", n_group=1, topk_group=1, routed_scaling_factor=scaling, n_shared_experts=1,
        dense_layers=tuple(range(first_dense)), eos_token_id=151329)


PRESETS = named_presets(
    _glm("glm-4.5", 92, 5120, 12288, 131072, 160, 1536, 2.5, 3, True),
    _glm("glm-4.5-air", 46, 4096, 10944, 131072, 128, 1408, 1.0, 1, False),
    _glm("glm-4.6", 92, 5120, 12288, 202752, 160, 1536, 2.5, 3, True))  # GLM-4.5's shape over a longer context

# q/k norms, biased q/k/v, a d_head (16) that is not d_model / n_heads, grouped kv heads and half of each head rotated;
# 8 experts in 2 groups, the better one open, 2 per token, one shared expert; the first block dense; weights 5x the
# usual scale so the sigmoid scores spread (conftest moves the correction bias away from zero).
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=48, vocab_size=101, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
            num_experts_per_tok=2, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
            use_qk_norm=True, attention_bias=True, initializer_range=0.1, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))

FAMILY = Family("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig", "GLM-4.5, GLM-4.5-Air, GLM-4.6", read, write,
                LAYOUT, PRESETS, TINY)

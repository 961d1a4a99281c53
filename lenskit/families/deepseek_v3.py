"""DeepSeek V3 (`deepseek_v3`; also R1, V3.1, and Kimi K2): multi-head latent attention (lenskit.pieces.latent_attention)
and, after the first `first_k_dense_replace` dense blocks, routed experts chosen by sigmoid scores within the best
groups plus shared experts (lenskit.pieces.shared_experts); YaRN whose `mscale_all_dim` also scales the scores.
transformers' files spell the routed experts fused (gate rows first) and the router `mlp.gate` with its correction
bias; a published checkpoint's multi-token-prediction block (`layers.<n_layers>`) is left unread, as transformers
leaves it."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import Family
from .fields import ConfigReader
from .layouts import LLAMA, SHARED_EXPERTS_BLOCK, FusedExperts, Layout, past_the_blocks
from .presets import named_presets
from .readers import common_fields, grouped_sigmoid_experts
from .rope import rope


def read(r: ConfigReader) -> dict[str, Any]:
    r.require("hidden_act", ("silu",), "silu")
    # remote-code spellings of what transformers' class fixes: sigmoid scores, the correction bias, every block past the
    # dense ones sparse
    r.require("scoring_func", ("sigmoid",), "sigmoid")
    r.require("topk_method", ("noaux_tc",), "noaux_tc")
    r.require("moe_layer_freq", (1,), 1)
    r.require("pretraining_tp", (1, None), 1)
    n_layers = r.n_layers("num_hidden_layers")
    n_heads = r.int("num_attention_heads")
    # transformers repeats the expanded keys and values over groups of num_attention_heads / num_key_value_heads query
    # heads, but kv_b expands one key and value per query head: only equal counts run
    n_kv = r.int("num_key_value_heads", 128, null=None)
    if n_kv is not None and n_kv != n_heads:
        raise ValueError(f"config field num_key_value_heads={n_kv} must equal num_attention_heads={n_heads}: latent "
                         f"attention expands one key and value per head (model_type={r.family!r}); fix config.json")
    d_rope, d_nope = r.int("qk_rope_head_dim", 64), r.int("qk_nope_head_dim", 128)
    fields = rope(r, d_rope, types=("default", "linear", "yarn"))
    if fields["rotary_dim"] != d_rope:
        raise ValueError(f"config field partial_rotary_factor: latent attention rotates all qk_rope_head_dim={d_rope} "
                         f"features; remove it (model_type={r.family!r})")
    if fields.get("rope_type", "default") != "default":  # transformers scales the scores by mscale_all_dim's gain squared
        params = r.d.get("rope_scaling") or r.d.get("rope_parameters") or {}
        mscale_all = ConfigReader(params, r.family, where="rope_parameters.").float("mscale_all_dim", None, null=None)
        fields["rope_mscale_all_dim"] = mscale_all or None  # 0 is absent, as transformers reads it
    experts = grouped_sigmoid_experts(r, n_layers, n=256, d_expert=2048, n_group=8, topk_group=4, first_dense=3,
                                      scaling=2.5)
    r.float("aux_loss_alpha", 0.0)  # typed only: a training loss, not part of the forward
    bias = r.bool("attention_bias", False)
    return {
        **common_fields(r, bos=0, eos=1), **fields,
        "n_layers": n_layers, "d_model": r.int("hidden_size"), "n_heads": n_heads, "n_kv_heads": n_heads,
        "d_head": r.int("v_head_dim", 128), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", 1e-6, positive=True), "norm": "rmsnorm", "mlp": "swiglu",
        "tie_word_embeddings": r.bool("tie_word_embeddings", False), "fused_qkv": False, "qkv_bias": bias,
        "out_bias": False, "mlp_bias": False,
        "kv_lora_rank": r.int("kv_lora_rank", 512), "q_lora_rank": r.int("q_lora_rank", 1536, null=None),
        "qk_nope_head_dim": d_nope, "rope_interleave": r.bool("rope_interleave", True),
        **experts,
    }


def write(cfg: ModelConfig) -> dict[str, Any]:
    params = writers.rope_parameters(cfg)
    params.pop("partial_rotary_factor", None)  # qk_rope_head_dim is the rotary width
    if cfg.rope.mscale_all_dim is not None:
        params["mscale_all_dim"] = cfg.rope.mscale_all_dim
    mla = cfg.mla
    return {
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps, **writers.common_fields(cfg),
        "rope_parameters": params, "rope_interleave": mla.rope_interleave, "attention_bias": cfg.attention.qkv_bias,
        "attention_dropout": 0.0, "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank,
        "qk_rope_head_dim": cfg.rope.dim, "qk_nope_head_dim": mla.qk_nope_head_dim, "v_head_dim": cfg.d_head,
        **writers.grouped_sigmoid_experts(cfg),
    }


_BLOCK = {
    "ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight", "attn.q_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_a.bias": "self_attn.q_a_proj.bias", "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b.weight": "self_attn.q_b_proj.weight", "attn.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a.bias": "self_attn.kv_a_proj_with_mqa.bias", "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b.weight": "self_attn.kv_b_proj.weight", "attn.out.weight": "self_attn.o_proj.weight",
    **SHARED_EXPERTS_BLOCK,
}


LAYOUT = Layout(prefix="model.", blocks="layers", top=LLAMA.top, block=_BLOCK, buffers=LLAMA.buffers,
                fused=FusedExperts(), unread=past_the_blocks)


def _preset(name: str, n_heads: int, d_vocab: int, n_ctx: int, n_experts: int, n_group: int, topk_group: int,
            scaling: float, first_dense: int, base: float, factor: float, beta_fast: float, bos: int, eos: int) -> ModelConfig:
    """DeepSeek V3's shape: 61 blocks of d_model 7168, q and kv latents of 1536 and 512, heads of 128 + 64 (rotary)
    query/key features and 128 value features, a dense MLP 18432 wide in the first blocks, then 8 of the routed
    experts (2048 wide) and one shared one; YaRN over a 4096-token pre-training length with mscale 1 and
    mscale_all_dim 1 (attention factor 1, the scores scaled by the gain squared)."""
    return ModelConfig(
        n_layers=61, d_model=7168, n_heads=n_heads, n_kv_heads=n_heads, d_head=128, d_mlp=18432, d_vocab=d_vocab,
        n_ctx=n_ctx, norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", tie_word_embeddings=False, family="deepseek_v3",
        positional="rotary", rotary_base=base, rotary_dim=64, rope_type="yarn", rope_factor=factor,
        rope_original_n_ctx=4096, rope_beta_fast=beta_fast, rope_beta_slow=1.0, rope_truncate=True,
        rope_attention_factor=1.0, rope_mscale_all_dim=1.0, fused_qkv=False, qkv_bias=False, out_bias=False,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, n_experts=n_experts, n_experts_per_token=8,
        d_expert=2048, routing="sigmoid_group_topk_renorm", n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=scaling, n_shared_experts=1, dense_layers=tuple(range(first_dense)),
        bos_token_id=bos, eos_token_id=eos, name=name,
    )


PRESETS = named_presets(
    _preset("deepseek-v3", 128, 129280, 163840, 256, 8, 4, 2.5, 3, 10000.0, 40.0, 32.0, 0, 1),
    _preset("kimi-k2", 64, 163840, 131072, 384, 1, 1, 2.827, 1, 50000.0, 32.0, 1.0, 163584, 163585))

# Latent attention with a q LoRA and YaRN whose mscale_all_dim scales the scores; 16 experts in 4 groups, the best 2
# groups open (8 experts, so transformers' default top-8 fits), 2 per token, one shared expert; the first block dense; weights 5x the usual scale so the sigmoid
# scores spread (conftest moves the correction bias away from zero).
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
            vocab_size=101, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, moe_intermediate_size=16,
            n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2,
            first_k_dense_replace=1, norm_topk_prob=True, initializer_range=0.1, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                                 mscale=1.0, mscale_all_dim=0.5, beta_fast=32.0, beta_slow=1.0))

FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", "DeepSeek V3 / R1, Kimi K2", read, write,
                LAYOUT, PRESETS, TINY)

"""What the family writers share: writing a `ModelConfig` as its family's Hugging Face `config.json`.

A family's own writer is its module's `write` (`lenskit.families.llama.write`), the way back from its reader. It
returns the family's fields in the spelling transformers 5 writes (`rope_parameters`, not `rope_theta` +
`rope_scaling`). A writer does not judge whether the family can express a config: the record (`Family.hf_config`)
reads what was written back through the family's reader and refuses, by field, a config that does not come back
unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import ModelConfig

_LAYER_TYPES = {"sliding": "sliding_attention", "full": "full_attention", "linear": "linear_attention"}


def hf_layer_type(kind: str) -> str:
    """A `ModelConfig.layer_types` entry as transformers spells it."""
    return _LAYER_TYPES[kind]


def hf_layer_types(cfg: "ModelConfig") -> list[str]:
    """`layer_types` as transformers spells it, one per block."""
    return [_LAYER_TYPES[cfg.layer_type(i)] for i in range(cfg.n_layers)]


def common_fields(cfg: "ModelConfig") -> dict[str, Any]:
    # No pad id: lenskit does not keep one (the tokenizer does), and some families' defaults (Phi-3's 32000)
    # lie outside a small vocabulary, which transformers refuses.
    return {
        "vocab_size": cfg.d_vocab, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": None, "initializer_range": cfg.initializer_range, "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def int_if_whole(x: float | None) -> float | int | None:
    """transformers 5's Gemma configs type query_pre_attn_scalar as an int and refuse 256.0."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def rope_parameters(cfg: "ModelConfig", base: float | None = None, scaled: bool = True, partial: bool = False) -> dict[str, Any]:
    """`rope_parameters` for our rotary fields, at `base` (default `rotary_base`); unscaled if not `scaled`.
    `partial_rotary_factor` is written when not 1, or always with `partial` (NeoX's default is 0.25)."""
    params: dict[str, Any] = {"rope_type": cfg.rope.type if scaled else "default",
                              "rope_theta": cfg.rope.base if base is None else base}
    rotary_dim = cfg.rope.dim or cfg.d_head
    if partial or rotary_dim != cfg.d_head:
        params["partial_rotary_factor"] = rotary_dim / cfg.d_head
    if params["rope_type"] == "linear":
        params["factor"] = cfg.rope.factor
    elif params["rope_type"] == "llama3":
        params.update(factor=cfg.rope.factor, low_freq_factor=cfg.rope.low_freq_factor,
                      high_freq_factor=cfg.rope.high_freq_factor,
                      original_max_position_embeddings=cfg.rope.original_n_ctx)
    elif params["rope_type"] == "yarn":
        params.update(factor=cfg.rope.factor, beta_fast=cfg.rope.beta_fast, beta_slow=cfg.rope.beta_slow,
                      truncate=cfg.rope.truncate, original_max_position_embeddings=cfg.rope.original_n_ctx)
        if cfg.rope.attention_factor is not None:
            params["attention_factor"] = cfg.rope.attention_factor
    return params


def llama_like(cfg: "ModelConfig", head_dim: bool = True) -> dict[str, Any]:
    """What the SwiGLU families share; `head_dim` only where transformers reads it (not Qwen 2, OLMo 2, Phi-3)."""
    return {
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        **({"head_dim": cfg.d_head} if head_dim else {}), "hidden_act": "silu", "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.norm_eps, **common_fields(cfg), "rope_parameters": rope_parameters(cfg), "attention_dropout": 0.0,
    }


def routed_experts(cfg: "ModelConfig", key: str) -> dict[str, Any]:
    return {key: cfg.moe.n_experts, "num_experts_per_tok": cfg.moe.n_experts_per_token, "output_router_logits": False}


def norm_topk(cfg: "ModelConfig") -> bool:
    return cfg.moe.routing == "softmax_topk_renorm"


def grouped_sigmoid_experts(cfg: "ModelConfig") -> dict[str, Any]:
    """The way back from `readers.grouped_sigmoid_experts`. Its dense blocks are the first ones: any other set would
    not read back, and `Family.hf_config` refuses it."""
    moe = cfg.moe
    return {
        "n_routed_experts": moe.n_experts, "num_experts_per_tok": moe.n_experts_per_token,
        "moe_intermediate_size": moe.d_expert, "n_group": moe.n_group, "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor, "n_shared_experts": moe.n_shared_experts,
        "norm_topk_prob": moe.routing == "sigmoid_group_topk_renorm", "first_k_dense_replace": len(moe.dense_layers),
        "output_router_logits": False,
    }


def gemma_like(cfg: "ModelConfig") -> dict[str, Any]:
    return {
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
        "hidden_activation": cfg.activation, "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps,
        **common_fields(cfg), "attention_bias": cfg.attention.qkv_bias, "query_pre_attn_scalar": int_if_whole(cfg.attention.query_pre_attn_scalar),
        "sliding_window": cfg.sliding_window,
        "layer_types": hf_layer_types(cfg),
        "final_logit_softcapping": cfg.final_softcap, "attention_dropout": 0.0,
    }

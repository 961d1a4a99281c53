"""Writing a `ModelConfig` as its family's Hugging Face `config.json`: one writer per family, the way back
from `readers.py`.

Each writer returns the family's fields in the spelling transformers 5 writes (`rope_parameters`, not
`rope_theta` + `rope_scaling`). A writer does not judge whether the family can express a config: the
registry (`Family.hf_config`) reads what was written back through the family's reader and refuses, by
field, a config that does not come back unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import ModelConfig

_LAYER_TYPES = {"sliding": "sliding_attention", "full": "full_attention", "linear": "linear_attention"}


def _common(cfg: "ModelConfig") -> dict[str, Any]:
    # No pad id: lenskit does not keep one (the tokenizer does), and some families' defaults (Phi-3's 32000)
    # lie outside a small vocabulary, which transformers refuses.
    return {
        "vocab_size": cfg.d_vocab, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": None, "initializer_range": cfg.initializer_range, "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def _int_if_whole(x: float | None) -> float | int | None:
    """transformers 5's Gemma configs type query_pre_attn_scalar as an int and refuse 256.0."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _rope(cfg: "ModelConfig", base: float | None = None, scaled: bool = True, partial: bool = False) -> dict[str, Any]:
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


def write_gpt2(cfg: "ModelConfig") -> dict[str, Any]:
    return {
        "n_layer": cfg.n_layers, "n_embd": cfg.d_model, "n_head": cfg.n_heads, "n_inner": cfg.d_mlp,
        "vocab_size": cfg.d_vocab, "n_positions": cfg.n_ctx, "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": cfg.activation, "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True, "use_cache": True,
    }


def write_gpt_neox(cfg: "ModelConfig") -> dict[str, Any]:
    return {
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_mlp, "max_position_embeddings": cfg.n_ctx, "layer_norm_eps": cfg.norm_eps,
        "hidden_act": cfg.activation, "use_parallel_residual": cfg.parallel_block, "attention_bias": cfg.attention.qkv_bias,
        "rope_parameters": _rope(cfg, partial=True), **_common(cfg),
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
    }


def _llama_like(cfg: "ModelConfig", head_dim: bool = True) -> dict[str, Any]:
    """What the SwiGLU families share; `head_dim` only where transformers reads it (not Qwen 2, OLMo 2, Phi-3)."""
    return {
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        **({"head_dim": cfg.d_head} if head_dim else {}), "hidden_act": "silu", "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.norm_eps, **_common(cfg), "rope_parameters": _rope(cfg), "attention_dropout": 0.0,
    }


def write_llama(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "mlp_bias": cfg.mlp_bias}


def write_mistral(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg), "sliding_window": cfg.sliding_window}


def write_qwen2(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg, head_dim=False), "use_sliding_window": False}


def write_qwen3(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "use_sliding_window": False}


def write_olmo2(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg, head_dim=False), "attention_bias": cfg.attention.qkv_bias}


def write_olmo3(cfg: "ModelConfig") -> dict[str, Any]:
    local = cfg.rope.base if cfg.rope.local_base is None else cfg.rope.local_base
    return {**_llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "sliding_window": cfg.sliding_window,
            "layer_types": [_LAYER_TYPES[cfg.layer_type(i)] for i in range(cfg.n_layers)],
            "rope_parameters": {"sliding_attention": _rope(cfg, base=local, scaled=False), "full_attention": _rope(cfg)}}


def write_smollm3(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "mlp_bias": cfg.mlp_bias,
            "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_layers)],
            "use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "layer_types": [_LAYER_TYPES[cfg.layer_type(i)] for i in range(cfg.n_layers)]}


def write_phi3(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg, head_dim=False), "sliding_window": cfg.sliding_window}


def write_qwen3_5_text(cfg: "ModelConfig") -> dict[str, Any]:
    linear = {} if cfg.linear.n_k_heads is None else {
        "linear_num_key_heads": cfg.linear.n_k_heads, "linear_num_value_heads": cfg.linear.n_v_heads,
        "linear_key_head_dim": cfg.linear.d_k, "linear_value_head_dim": cfg.linear.d_v,
        "linear_conv_kernel_dim": cfg.linear.conv_width}
    types = cfg.layer_types or ("full",) * cfg.n_layers
    return {**_llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "rope_parameters": _rope(cfg, partial=True),
            "layer_types": [_LAYER_TYPES[t] for t in types], **linear}


def _experts(cfg: "ModelConfig", key: str) -> dict[str, Any]:
    return {key: cfg.moe.n_experts, "num_experts_per_tok": cfg.moe.n_experts_per_token, "output_router_logits": False}


def _norm_topk(cfg: "ModelConfig") -> bool:
    return cfg.moe.routing == "softmax_topk_renorm"


def write_mixtral(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg), "sliding_window": cfg.sliding_window, **_experts(cfg, "num_local_experts"),
            "router_jitter_noise": 0.0}


def write_qwen3_moe(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "use_sliding_window": False,
            "moe_intermediate_size": cfg.moe.d_expert, "norm_topk_prob": _norm_topk(cfg), "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.moe.dense_layers), **_experts(cfg, "num_experts")}


def write_olmoe(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg, head_dim=False), "attention_bias": cfg.attention.qkv_bias, "clip_qkv": None,
            "norm_topk_prob": _norm_topk(cfg), **_experts(cfg, "num_experts")}


def write_gpt_oss(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "sliding_window": cfg.sliding_window,
            "layer_types": [_LAYER_TYPES[cfg.layer_type(i)] for i in range(cfg.n_layers)],
            "swiglu_alpha": cfg.moe.swiglu_alpha, "swiglu_limit": cfg.moe.swiglu_limit,
            **_experts(cfg, "num_local_experts")}


def _gemma(cfg: "ModelConfig") -> dict[str, Any]:
    return {
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
        "hidden_activation": cfg.activation, "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps,
        **_common(cfg), "attention_bias": cfg.attention.qkv_bias, "query_pre_attn_scalar": _int_if_whole(cfg.attention.query_pre_attn_scalar),
        "sliding_window": cfg.sliding_window,
        "layer_types": [_LAYER_TYPES[cfg.layer_type(i)] for i in range(cfg.n_layers)],
        "final_logit_softcapping": cfg.final_softcap, "attention_dropout": 0.0,
    }


def write_gemma2(cfg: "ModelConfig") -> dict[str, Any]:
    return {**_gemma(cfg), "rope_parameters": _rope(cfg), "attn_logit_softcapping": cfg.attention.softcap}


def write_gemma3_text(cfg: "ModelConfig") -> dict[str, Any]:
    local = cfg.rope.base if cfg.rope.local_base is None else cfg.rope.local_base
    return {**_gemma(cfg), "attn_logit_softcapping": None,
            "rope_parameters": {"sliding_attention": _rope(cfg, base=local, scaled=False), "full_attention": _rope(cfg)}}


def write_gemma4_text(cfg: "ModelConfig") -> dict[str, Any]:
    full = next((i for i in range(cfg.n_layers) if cfg.layer_type(i) == "full"), cfg.n_layers - 1)
    glob: dict[str, Any] = {"rope_type": cfg.rope.type, "rope_theta": cfg.rope.base}
    if cfg.rope.type == "proportional":
        glob.update(partial_rotary_factor=cfg.rope.proportion, factor=cfg.rope.factor)
    local = cfg.rope.base if cfg.rope.local_base is None else cfg.rope.local_base
    return {
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
        "global_head_dim": cfg.d_head_of(full), "num_global_key_value_heads": cfg.attention.full_n_kv_heads,
        "attention_k_eq_v": cfg.attention.full_k_is_v, "hidden_activation": cfg.activation, "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.norm_eps, **_common(cfg), "attention_bias": cfg.attention.qkv_bias,
        "sliding_window": cfg.sliding_window if cfg.sliding_window is not None else 512,
        "layer_types": [_LAYER_TYPES[cfg.layer_type(i)] for i in range(cfg.n_layers)],
        "final_logit_softcapping": cfg.final_softcap, "attention_dropout": 0.0,
        "hidden_size_per_layer_input": cfg.block.d_per_layer or 0,
        "vocab_size_per_layer_input": cfg.d_vocab if cfg.block.d_per_layer is None else cfg.block.d_vocab_per_layer,
        "num_kv_shared_layers": cfg.block.n_kv_shared_layers, "use_double_wide_mlp": cfg.block.double_wide_mlp,
        "enable_moe_block": cfg.block.experts_beside_mlp,
        **({"num_experts": cfg.moe.n_experts, "top_k_experts": cfg.moe.n_experts_per_token, "moe_intermediate_size": cfg.moe.d_expert}
           if cfg.block.experts_beside_mlp else {}),
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": local}, "full_attention": glob},
    }

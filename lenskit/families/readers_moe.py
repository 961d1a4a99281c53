"""Config readers of the mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE, gpt-oss): the dense readers'
attention and norm fields (`readers.py`), plus the experts, their routing rule and each family's own extras."""

from __future__ import annotations

from typing import Any

from .fields import ConfigReader
from .readers import llama_like, no_qwen_sliding, sliding_windows


_SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def _experts(r: ConfigReader, key: str, alias: str, n: int, k: int, renorm: bool) -> dict[str, Any]:
    """The router's fields. The expert count is `key`, or `alias`, the other spelling the family's config class maps
    onto it; `n` and `k` are transformers' defaults; `renorm`: the top-k weights are renormalised to sum to 1."""
    for shared in _SHARED_EXPERT_FIELDS:
        if r.d.get(shared):
            raise ValueError(f"config field {shared}={r.d[shared]!r}: shared experts are not implemented in lenskit "
                             f"(model_type={r.family!r}); lenskit implements routed experts only")
    n_experts = r.int(key, n)
    if alias in r.d:
        other = r.int(alias)
        if key in r.d and other != n_experts:
            raise ValueError(f"config fields {key}={n_experts} and {alias}={other} disagree: both spell the number of "
                             f"experts (model_type={r.family!r}); keep one of them")
        key, n_experts = alias, other
    per_token = r.int("num_experts_per_tok", k)
    if per_token > n_experts:
        raise ValueError(f"config field num_experts_per_tok={per_token} exceeds {key}={n_experts}: each token is routed "
                         f"to k of the experts (model_type={r.family!r}); fix config.json")
    r.float("router_aux_loss_coef", 0.0)  # typed only: a training loss, not part of the forward
    return {"n_experts": n_experts, "n_experts_per_token": per_token,
            "routing": "softmax_topk_renorm" if renorm else "softmax_topk"}


def _rotary_base_default(r: ConfigReader, fields: dict[str, Any], theta: float) -> dict[str, Any]:
    """`fields` with the family's own rotary base where config.json gives none anywhere (Mixtral's is 1e6)."""
    given = r.d.get("rope_theta") is not None or any(
        isinstance(r.d.get(k), dict) and "rope_theta" in r.d[k] for k in ("rope_parameters", "rope_scaling"))
    return fields if given else {**fields, "rotary_base": theta}


def read_mixtral(r: ConfigReader) -> dict[str, Any]:
    r.float("router_jitter_noise", 0.0)  # typed only: noise on the router's input in training, off at inference
    fields = llama_like(r, False, False, False, eps=1e-5, bos=1, eos=2, kv_heads=8, null_kv_heads=False)
    return {**_rotary_base_default(r, fields, 1_000_000.0), "sliding_window": r.int("sliding_window", None),
            **_experts(r, "num_local_experts", "num_experts", 8, 2, renorm=True)}


def read_qwen3_moe(r: ConfigReader) -> dict[str, Any]:
    no_qwen_sliding(r)
    bias = r.bool("attention_bias", False)
    fields = llama_like(r, bias, bias, False, eps=1e-6, bos=None, eos=None, kv_heads=4, null_head_dim=False,
                          null_kv_heads=False)
    n = fields["n_layers"]
    step = r.int("decoder_sparse_step", 1)
    only = r.d.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in only):
        raise ValueError(f"config field mlp_only_layers={only!r} must list block indices in [0, {n}) "
                         f"(model_type={r.family!r})")
    experts = _experts(r, "num_experts", "num_local_experts", 128, 8, renorm=r.bool("norm_topk_prob", False))
    return {**fields, **experts, "qk_norm": True, "d_expert": r.int("moe_intermediate_size", 768),
            "dense_layers": tuple(i for i in range(n) if i in only or (i + 1) % step)}


def read_olmoe(r: ConfigReader) -> dict[str, Any]:
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
            **_experts(r, "num_experts", "num_local_experts", 64, 8, renorm=r.bool("norm_topk_prob", False))}


# gpt-oss: transformers 5's GptOssConfig fills absent rotary fields with YaRN over a 4096-token pre-training length.
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def read_gpt_oss(r: ConfigReader) -> dict[str, Any]:
    """gpt-oss: attention sinks, every other block sliding (from the first), YaRN, biases on q/k/v/o and the router,
    the top k logits then a softmax, and biased experts with the clamped SwiGLU."""
    bias = r.bool("attention_bias", True)
    fields = llama_like(r, bias, bias, False, eps=1e-5, bos=None, eos=None, kv_heads=8, head_dim=64,
                         null_head_dim=False, null_kv_heads=False, rope_types=("default", "yarn"), default_theta=150000.0, default_params=_GPT_OSS_ROPE)
    experts = _experts(r, "num_local_experts", "num_experts", 128, 4, renorm=False)
    return {**fields, **experts, **sliding_windows(r, fields["n_layers"], 2, 128), "attn_sinks": True, "routing": "topk_softmax",
            "mlp": "swiglu_clamped", "router_bias": True, "swiglu_alpha": r.float("swiglu_alpha", 1.702, positive=True),
            "swiglu_limit": r.float("swiglu_limit", 7.0, positive=True)}

"""Reading a Hugging Face `config.json` into `ModelConfig` fields: one reader per family.

Each reader reads the fields it implements with strict types, and refuses, by name, any field whose value
would make the checkpoint compute something lenskit does not implement. Readers return plain dicts of
`ModelConfig` keyword arguments, so this module imports only config's constants. Which reader a `model_type` gets
is the registry's business (`lenskit.families`); `writers.py` is the way back.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from ..config import GELU_ACTIVATIONS, ROPE_TYPES


class _Reader:
    """Typed access to one config dict; every error names the field."""

    def __init__(self, d: Mapping[str, Any], family: str) -> None:
        self.d, self.family = d, family

    def _bad(self, key: str, want: str) -> ValueError:
        return ValueError(f"config field {key}={self.d[key]!r} must be {want} (model_type={self.family!r})")

    def int(self, key: str, default: Any = ..., positive: bool = True) -> int | None:
        if key not in self.d or self.d[key] is None:
            if default is ...:
                raise ValueError(f"config.json lacks required field {key!r} for model_type={self.family!r}")
            return default
        value = self.d[key]
        if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0):
            raise self._bad(key, "a positive integer" if positive else "an integer")
        return value

    def float(self, key: str, default: Any = ...) -> float:
        if key not in self.d or self.d[key] is None:
            if default is ...:
                raise ValueError(f"config.json lacks required field {key!r} for model_type={self.family!r}")
            return default
        value = self.d[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(key, "a finite number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.d.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false (a JSON boolean, not a string or number)")
        return value

    def token_id(self, key: str) -> int | None:
        value = self.d.get(key)
        if isinstance(value, list):  # several EOS ids: the first is the one text generation stops on
            value = value[0] if value else None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._bad(key, "a non-negative integer token id")
        return value

    def require(self, key: str, supported: tuple, default: Any = None) -> Any:
        """The field's value, refused unless it is one of `supported` (absent counts as `default`)."""
        value = self.d.get(key, default)
        if value not in supported:
            raise ValueError(
                f"config field {key}={value!r} is not supported for model_type={self.family!r}; "
                f"lenskit implements {list(supported)}"
            )
        return value


def _rope(r: _Reader, head_dim: int, default_theta: float = 10000.0) -> dict[str, Any]:
    """Rotary fields from either spelling: transformers 5's `rope_parameters` or 4.x's `rope_theta` + `rope_scaling`."""
    d = r.d
    params = d.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = d.get("rope_scaling"), "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"config field {key}={params!r} must be an object")
    if isinstance(next(iter(params.values()), None), dict):
        raise ValueError(f"config field {key} holds per-layer-type rotary settings; lenskit implements one setting for every layer")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config field {key}.rope_type={rope_type!r} is not supported; lenskit implements {list(ROPE_TYPES)}")
    sub = _Reader(params, r.family)
    theta = sub.float("rope_theta", r.float("rope_theta", default_theta))
    fraction = sub.float("partial_rotary_factor", r.float("partial_rotary_factor", 1.0))
    fields: dict[str, Any] = {"positional": "rotary", "rotary_base": theta, "rotary_dim": int(head_dim * fraction)}
    if rope_type == "linear":
        fields.update(rope_type="linear", rope_factor=sub.float("factor"))
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"})
        if extra:
            raise ValueError(f"config field {key} has {extra}, which rope_type='linear' does not use; lenskit refuses to guess")
    elif rope_type == "llama3":
        fields.update(rope_type="llama3", rope_factor=sub.float("factor"), rope_low_freq_factor=sub.float("low_freq_factor"),
                      rope_high_freq_factor=sub.float("high_freq_factor"),
                      rope_original_n_ctx=sub.int("original_max_position_embeddings"))
    else:
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if extra:
            raise ValueError(f"config field {key} has {extra}, which rope_type='default' does not use; lenskit refuses to guess")
    return fields


def _common(r: _Reader) -> dict[str, Any]:
    return {
        "family": r.family,
        "bos_token_id": r.token_id("bos_token_id"),
        "eos_token_id": r.token_id("eos_token_id"),
        "initializer_range": r.float("initializer_range", 0.02),
    }


def read_gpt2(r: _Reader) -> dict[str, Any]:
    refuse = {"add_cross_attention": False, "scale_attn_by_inverse_layer_idx": False,
              "reorder_and_upcast_attn": False, "scale_attn_weights": True}
    for field, supported in refuse.items():
        r.require(field, (supported,), supported)
    act = r.d.get("activation_function", "gelu_new")
    if act not in GELU_ACTIVATIONS:
        raise ValueError(f"config field activation_function={act!r} is not a GPT-2 activation; supported: {sorted(GELU_ACTIVATIONS)}")
    return {
        **_common(r),
        "n_layers": r.int("n_layer"), "d_model": r.int("n_embd"), "n_heads": r.int("n_head"),
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("n_positions"), "d_mlp": r.int("n_inner", None),
        "norm_eps": r.float("layer_norm_epsilon", 1e-5), "activation": act,
        "tie_word_embeddings": r.bool("tie_word_embeddings", True),
    }


def read_gpt_neox(r: _Reader) -> dict[str, Any]:
    act = r.require("hidden_act", tuple(GELU_ACTIVATIONS), "gelu")
    d_model, n_heads = r.int("hidden_size"), r.int("num_attention_heads")
    bias = r.bool("attention_bias", True)
    return {
        **_common(r),
        "n_layers": r.int("num_hidden_layers"), "d_model": d_model, "n_heads": n_heads,
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("layer_norm_eps", 1e-5), "activation": act,
        "tie_word_embeddings": r.bool("tie_word_embeddings", False),
        "parallel_block": r.bool("use_parallel_residual", True), "fused_qkv": True, "qkv_bias": bias, "out_bias": bias,
        **_rope(_Reader({"partial_rotary_factor": r.d.get("rotary_pct", 0.25), "rope_theta": r.d.get("rotary_emb_base", 10000.0),
                         **{k: r.d[k] for k in ("rope_parameters", "rope_scaling") if k in r.d}}, r.family), d_model // n_heads),
    }


def _llama_like(r: _Reader, qkv_bias: bool, out_bias: bool, mlp_bias: bool) -> dict[str, Any]:
    r.require("hidden_act", ("silu",), "silu")
    d_model, n_heads = r.int("hidden_size"), r.int("num_attention_heads")
    d_head = r.int("head_dim", None) or d_model // n_heads
    return {
        **_common(r),
        "n_layers": r.int("num_hidden_layers"), "d_model": d_model, "n_heads": n_heads, "d_head": d_head,
        "n_kv_heads": r.int("num_key_value_heads", n_heads), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", 1e-6), "norm": "rmsnorm", "mlp": "swiglu",
        "tie_word_embeddings": r.bool("tie_word_embeddings", False), "fused_qkv": False,
        "qkv_bias": qkv_bias, "out_bias": out_bias, "mlp_bias": mlp_bias, **_rope(r, d_head),
    }


def read_llama(r: _Reader) -> dict[str, Any]:
    bias = r.bool("attention_bias", False)
    return _llama_like(r, bias, bias, r.bool("mlp_bias", False))


def read_mistral(r: _Reader) -> dict[str, Any]:
    return {**_llama_like(r, False, False, False), "sliding_window": r.int("sliding_window", None)}


def _no_qwen_sliding(r: _Reader) -> None:
    r.require("use_sliding_window", (False, None), False)
    types = r.d.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise ValueError("config field layer_types has non-'full_attention' layers; lenskit implements only full attention for qwen")


def read_qwen2(r: _Reader) -> dict[str, Any]:
    _no_qwen_sliding(r)
    return _llama_like(r, True, False, False)


def read_qwen3(r: _Reader) -> dict[str, Any]:
    _no_qwen_sliding(r)
    bias = r.bool("attention_bias", False)
    return {**_llama_like(r, bias, bias, False), "qk_norm": True}


_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def _layer_types(r: _Reader, n_layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma's per-block attention kinds: `layer_types`, or every `pattern`-th block global, the rest sliding."""
    types = r.d.get("layer_types")
    if types is None:
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"config field layer_types={types!r} must list one of {sorted(_LAYER_TYPES)} for each of the "
                         f"{n_layers} layers (model_type={r.family!r})")
    return tuple(_LAYER_TYPES[t] for t in types)


def _gemma(r: _Reader, pattern: int) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share: (1 + w) RMSNorms before and after each sublayer, a scaled embedding,
    GELU-gated MLP, query_pre_attn_scalar, alternating sliding-window and global blocks."""
    r.require("use_bidirectional_attention", (False, None), False)
    act = r.require("hidden_activation", tuple(GELU_ACTIVATIONS), "gelu_pytorch_tanh")
    d_model, n_heads = r.int("hidden_size"), r.int("num_attention_heads")
    n_layers = r.int("num_hidden_layers")
    bias = r.bool("attention_bias", False)
    types = _layer_types(r, n_layers, pattern)
    return {
        **_common(r),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "d_head": r.int("head_dim", None) or d_model // n_heads,
        "n_kv_heads": r.int("num_key_value_heads", n_heads), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", 1e-6), "norm": "rmsnorm_offset", "mlp": "geglu", "activation": act,
        "norm_placement": "sandwich", "scale_embed": True, "tie_word_embeddings": r.bool("tie_word_embeddings", True),
        "fused_qkv": False, "qkv_bias": bias, "out_bias": bias, "mlp_bias": False,
        "query_pre_attn_scalar": r.float("query_pre_attn_scalar", 256.0), "layer_types": types,
        "sliding_window": r.int("sliding_window") if "sliding" in types else None,
    }


def _cap(r: _Reader, key: str, default: float | None) -> float | None:
    """A soft-cap: absent means transformers' default for the family, an explicit null means no cap."""
    return None if key in r.d and r.d[key] is None else r.float(key, default)


def read_gemma2(r: _Reader) -> dict[str, Any]:
    fields = _gemma(r, pattern=2)
    return {**fields, **_rope(r, fields["d_head"]),
            "attn_softcap": _cap(r, "attn_logit_softcapping", 50.0), "final_softcap": _cap(r, "final_logit_softcapping", 30.0)}


def read_gemma3_text(r: _Reader) -> dict[str, Any]:
    # transformers' Gemma 3 attention stores attn_logit_softcapping but never applies it: refused rather than guessed.
    r.require("attn_logit_softcapping", (None,), None)
    fields = _gemma(r, pattern=r.int("sliding_window_pattern", 6))
    return {**fields, **_gemma3_rope(r, fields["d_head"]), "qk_norm": True,
            "final_softcap": _cap(r, "final_logit_softcapping", None)}


def _gemma3_rope(r: _Reader, head_dim: int) -> dict[str, Any]:
    """Gemma 3's two rotary settings: global blocks (`full_attention`: base, maybe linear scaling) and local
    blocks (`sliding_attention`: their own base, unscaled). Either transformers 5's per-layer-type
    `rope_parameters` or 4.x's `rope_theta`, `rope_local_base_freq` and `rope_scaling` (global only)."""
    params = r.d.get("rope_parameters")
    if params is None:
        legacy = {"rope_theta": r.d.get("rope_theta", 1_000_000.0), **{k: r.d[k] for k in ("rope_scaling",) if k in r.d}}
        glob = _rope(_Reader(legacy, r.family), head_dim)
        local = _Reader({"rope_local_base_freq": r.d.get("rope_local_base_freq", 10000.0)}, r.family).float("rope_local_base_freq")
        return {**glob, "local_rotary_base": local}
    if not isinstance(params, dict) or set(params) - set(_LAYER_TYPES):
        raise ValueError(f"config field rope_parameters={params!r} must map {sorted(_LAYER_TYPES)} to rotary settings "
                         f"(model_type={r.family!r})")
    glob = _rope(_Reader({"rope_parameters": params.get("full_attention") or {"rope_theta": 1_000_000.0}}, r.family), head_dim)
    local = _rope(_Reader({"rope_parameters": params.get("sliding_attention") or {"rope_theta": 10000.0}}, r.family), head_dim)
    if local.get("rope_type", "default") != "default" or local["rotary_dim"] != glob["rotary_dim"]:
        raise ValueError("config field rope_parameters.sliding_attention: lenskit implements only plain rotary with the "
                         "global blocks' rotary dims for Gemma 3's local blocks")
    return {**glob, "local_rotary_base": local["rotary_base"]}


def read_olmo2(r: _Reader) -> dict[str, Any]:
    bias = r.bool("attention_bias", False)
    return {**_llama_like(r, bias, bias, False), "qk_norm": True, "qk_norm_per_head": False, "norm_placement": "post"}


def read_phi3(r: _Reader) -> dict[str, Any]:
    r.int("original_max_position_embeddings", None)  # typed only: it matters to longrope scaling, which _rope refuses
    return {**_llama_like(r, False, False, False), "fused_qkv": True, "mlp": "swiglu_fused",
            "sliding_window": r.int("sliding_window", None)}


def read_config(d: Mapping[str, Any], model_type: str, read: Callable[[_Reader], dict[str, Any]]) -> dict[str, Any]:
    """`ModelConfig` keyword arguments for the config dict `d` of `model_type`, read by the family's `read`."""
    r = _Reader(d, model_type)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        r.float(key, 0.0)  # typed only: dropout is off at inference and lenskit's own `dropout` governs training
    return read(r)

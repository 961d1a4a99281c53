"""Reading a Hugging Face `config.json` into `ModelConfig` fields: one reader per family.

Each reader reads the fields it implements with strict types (`fields.ConfigReader`; the rotary ones through
`rope.py`), and refuses, by name, any field whose value would make the checkpoint compute something lenskit does
not implement. Readers return plain dicts of `ModelConfig` keyword arguments, so this module imports only config's
constants. Which reader a `model_type` gets is the registry's business (`lenskit.families`); `writers.py` is the
way back.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..config import ACTIVATIONS, GELU_ACTIVATIONS, ROPE_TYPES
from ..io.mxfp4 import check_family_quantization
from .fields import HF_LAYER_TYPES, REFUSED, ConfigReader
from .readers_gemma4 import gemma4_extras
from .rope import gemma3_rope, gemma4_rope, olmo3_rope, rope


def _heads(r: ConfigReader, d_model_key: str, heads_key: str, *, must_divide: bool) -> tuple[int, int]:
    """d_model and n_heads; `must_divide`: transformers refuses a d_model that n_heads does not divide, even with an
    explicit head_dim (GPT-2, GPT-NeoX, Llama, Gemma)."""
    d_model, n_heads = r.int(d_model_key), r.int(heads_key)
    if must_divide and d_model % n_heads:
        raise ValueError(f"config fields {d_model_key}={d_model} and {heads_key}={n_heads}: {heads_key} must divide "
                         f"{d_model_key} for model_type={r.family!r} (transformers refuses it too); fix config.json")
    return d_model, n_heads


def _kv_heads(r: ConfigReader, n_heads: int, default: int | None, null_derives: bool = True) -> int:
    """num_key_value_heads: absent is the family's default (None: n_heads, no grouping); null is n_heads where
    transformers derives it. It must divide n_heads."""
    key = "num_key_value_heads"
    n_kv = r.int(key, default, null=None if null_derives else REFUSED)
    n_kv = n_heads if n_kv is None else n_kv
    if n_heads % n_kv:
        source = f"{key}={n_kv}" if r.d.get(key) is not None else f"{key}={n_kv} (transformers' default for an absent field)"
        raise ValueError(f"config field {source} must divide num_attention_heads={n_heads}: each kv head serves a whole "
                         f"group of query heads (n_kv_heads; model_type={r.family!r}); fix config.json")
    return n_kv


def _head_dim(r: ConfigReader, d_model: int, n_heads: int, default: int | None, null_derives: bool = True) -> int:
    """head_dim: absent is the family's default (None: d_model // n_heads); null derives where transformers does."""
    d_head = r.int("head_dim", default, null=None if null_derives else REFUSED)
    return d_model // n_heads if d_head is None else d_head


def _common(r: ConfigReader, bos: int | None, eos: int | None) -> dict[str, Any]:
    """The fields every family has; `bos` and `eos` are the family's default token ids."""
    return {
        "family": r.family,
        "bos_token_id": r.token_id("bos_token_id", bos),
        "eos_token_id": r.token_id("eos_token_id", eos),
        "initializer_range": r.float("initializer_range", 0.02),
    }


# Each reader's defaults are transformers 5's for an absent field (its config class built with no arguments; the
# derived ones, "None: d_model // n_heads", follow its __post_init__). Sizes stay required: transformers' defaults
# for them are one published model's, never what a config without them meant.
def read_gpt2(r: ConfigReader) -> dict[str, Any]:
    refuse = {"add_cross_attention": False, "scale_attn_by_inverse_layer_idx": False,
              "reorder_and_upcast_attn": False, "scale_attn_weights": True}
    for field, supported in refuse.items():
        r.require(field, (supported,), supported)
    act = r.d.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(f"config field activation_function={act!r} is not an activation lenskit builds; supported: {sorted(ACTIVATIONS)}")
    n_layers = r.n_layers("n_layer")
    d_model, n_heads = _heads(r, "n_embd", "n_head", must_divide=True)
    return {
        **_common(r, bos=50256, eos=50256),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("n_positions"), "d_mlp": r.int("n_inner", None),
        "norm_eps": r.float("layer_norm_epsilon", 1e-5, positive=True), "activation": act,
        "tie_word_embeddings": r.bool("tie_word_embeddings", True),
    }


def read_gpt_neox(r: ConfigReader) -> dict[str, Any]:
    act = r.require("hidden_act", ACTIVATIONS, "gelu")
    n_layers = r.n_layers("num_hidden_layers")
    d_model, n_heads = _heads(r, "hidden_size", "num_attention_heads", must_divide=True)
    bias = r.bool("attention_bias", True)
    return {
        **_common(r, bos=0, eos=2),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("layer_norm_eps", 1e-5, positive=True), "activation": act,
        "tie_word_embeddings": r.bool("tie_word_embeddings", False),
        "parallel_block": r.bool("use_parallel_residual", True), "fused_qkv": True, "qkv_bias": bias, "out_bias": bias,
        # transformers 5's GPT-NeoX reads rotary_emb_base and rotary_pct, not the top-level rope_theta of other families
        **rope(r, d_model // n_heads, theta_key="rotary_emb_base", fraction_key="rotary_pct", default_fraction=0.25,
                unread=("rope_theta", "partial_rotary_factor")),
    }


def llama_like(r: ConfigReader, qkv_bias: bool, out_bias: bool, mlp_bias: bool, *, eps: float, bos: int | None,
               eos: int | None, kv_heads: int | None = None, head_dim: int | None = None, null_head_dim: bool = True,
               null_kv_heads: bool = True, must_divide: bool = False, rope_types: tuple[str, ...] = ROPE_TYPES,
               rotary: Callable[[ConfigReader, int], dict[str, Any]] | None = None, **rope_defaults: Any) -> dict[str, Any]:
    """What the SwiGLU families share. The keywords are the family's transformers defaults: `kv_heads` and `head_dim`
    None derive (n_heads; d_model // n_heads); `null_*`: whether an explicit null derives too or is refused;
    `rope_defaults` go to `rope` (a family's own base and settings for absent rotary fields); `rotary`, where given,
    reads the rotary fields instead of `rope` (per-layer-type settings: OLMo 3)."""
    r.require("hidden_act", ("silu",), "silu")
    n_layers = r.n_layers("num_hidden_layers")
    d_model, n_heads = _heads(r, "hidden_size", "num_attention_heads", must_divide=must_divide)
    d_head = _head_dim(r, d_model, n_heads, head_dim, null_head_dim)
    return {
        **_common(r, bos, eos),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "d_head": d_head,
        "n_kv_heads": _kv_heads(r, n_heads, kv_heads, null_kv_heads), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", eps, positive=True), "norm": "rmsnorm", "mlp": "swiglu",
        "tie_word_embeddings": r.bool("tie_word_embeddings", False), "fused_qkv": False,
        "qkv_bias": qkv_bias, "out_bias": out_bias, "mlp_bias": mlp_bias, **(rope(r, d_head, types=rope_types, **rope_defaults) if rotary is None else rotary(r, d_head)),
    }


def read_llama(r: ConfigReader) -> dict[str, Any]:
    bias = r.bool("attention_bias", False)
    return llama_like(r, bias, bias, r.bool("mlp_bias", False), eps=1e-6, bos=1, eos=2, must_divide=True)


def read_mistral(r: ConfigReader) -> dict[str, Any]:
    # A null sliding_window is no window (Mistral 7B v0.2 on); an absent one is transformers' 4096.
    return {**llama_like(r, False, False, False, eps=1e-6, bos=1, eos=2, kv_heads=8, null_kv_heads=False),
            "sliding_window": r.int("sliding_window", 4096, null=None)}


def no_qwen_sliding(r: ConfigReader) -> None:
    r.require("use_sliding_window", (False,), False)
    types = r.d.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise ValueError("config field layer_types has non-'full_attention' layers; lenskit implements only full attention for qwen")


def read_qwen2(r: ConfigReader) -> dict[str, Any]:
    no_qwen_sliding(r)
    return llama_like(r, True, False, False, eps=1e-6, bos=None, eos=None, kv_heads=32)


def read_qwen3(r: ConfigReader) -> dict[str, Any]:
    no_qwen_sliding(r)
    bias = r.bool("attention_bias", False)
    return {**llama_like(r, bias, bias, False, eps=1e-6, bos=None, eos=None, kv_heads=32, head_dim=128,
                          null_head_dim=False), "qk_norm": True}


def _layer_types(r: ConfigReader, n_layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma's per-block attention kinds: `layer_types`, or every `pattern`-th block global, the rest sliding."""
    types = r.d.get("layer_types")
    if types is None:
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers or any(t not in HF_LAYER_TYPES for t in types):
        raise ValueError(f"config field layer_types={types!r} must list one of {sorted(HF_LAYER_TYPES)} for each of the "
                         f"{n_layers} layers (model_type={r.family!r})")
    return tuple(HF_LAYER_TYPES[t] for t in types)


def sliding_windows(r: ConfigReader, n_layers: int, pattern: int, window: int) -> dict[str, Any]:
    """Per-block attention kinds (`_layer_types`) and the sliding blocks' window (`window` where absent)."""
    types = _layer_types(r, n_layers, pattern)
    window = r.int("sliding_window", window, null=None)
    if window is None and "sliding" in types:  # transformers would run its sliding blocks without a window
        raise ValueError(f"config field sliding_window=None, but layer_types has sliding-window blocks; give the window "
                         f"(model_type={r.family!r})")
    return {"layer_types": types, "sliding_window": window if "sliding" in types else None}


def _gemma(r: ConfigReader, pattern: int) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share: (1 + w) RMSNorms before and after each sublayer, a scaled embedding,
    GELU-gated MLP, query_pre_attn_scalar, alternating sliding-window and global blocks."""
    r.require("use_bidirectional_attention", (False, None), False)
    act = r.require("hidden_activation", tuple(GELU_ACTIVATIONS), "gelu_pytorch_tanh")
    n_layers = r.n_layers("num_hidden_layers")  # before anything built per layer
    d_model, n_heads = _heads(r, "hidden_size", "num_attention_heads", must_divide=True)
    bias = r.bool("attention_bias", False)
    return {
        **_common(r, bos=2, eos=1),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
        "d_head": _head_dim(r, d_model, n_heads, 256, null_derives=False),
        "n_kv_heads": _kv_heads(r, n_heads, 4, null_derives=False), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", 1e-6, positive=True), "norm": "rmsnorm_offset", "mlp": "geglu",
        "activation": act, "norm_placement": "sandwich", "scale_embed": True,
        "tie_word_embeddings": r.bool("tie_word_embeddings", True), "fused_qkv": False, "qkv_bias": bias,
        "out_bias": bias, "mlp_bias": False, "query_pre_attn_scalar": r.float("query_pre_attn_scalar", 256.0, positive=True),
        **sliding_windows(r, n_layers, pattern, 4096),
    }


def _cap(r: ConfigReader, key: str, default: float | None) -> float | None:
    """A soft-cap: absent means transformers' default for the family, an explicit null means no cap."""
    return r.float(key, default, positive=True, null=None)


def read_gemma2(r: ConfigReader) -> dict[str, Any]:
    fields = _gemma(r, pattern=2)
    return {**fields, **rope(r, fields["d_head"]),
            "attn_softcap": _cap(r, "attn_logit_softcapping", 50.0), "final_softcap": _cap(r, "final_logit_softcapping", 30.0)}


def read_gemma3_text(r: ConfigReader) -> dict[str, Any]:
    # transformers' Gemma 3 attention stores attn_logit_softcapping but never applies it: refused rather than guessed.
    r.require("attn_logit_softcapping", (None,), None)
    fields = _gemma(r, pattern=r.int("sliding_window_pattern", 6))
    return {**fields, **gemma3_rope(r, fields["d_head"]), "qk_norm": True,
            "final_softcap": _cap(r, "final_logit_softcapping", None)}


def read_gemma4_text(r: ConfigReader) -> dict[str, Any]:
    """Gemma 4's text model: Gemma's sandwich block with plain-gain RMSNorms, q/k norms and a gainless value norm,
    attention scores unscaled (the norms set their size), full blocks with their own head width and kv heads (and
    values that are their keys, `attention_k_eq_v`), proportional rotary on the full blocks, a stored scalar per block;
    per-layer inputs, kv sharing and experts beside the MLP where the config has them (`gemma4_extras`)."""
    r.require("use_bidirectional_attention", (None, "vision"), None)  # "vision" concerns image tokens only
    r.require("attn_logit_softcapping", (None,), None)  # not a Gemma 4 field; refused rather than ignored
    for key in ("rope_scaling", "rope_theta", "rope_local_base_freq", "partial_rotary_factor"):
        r.require(key, (None,), None)  # transformers 5 reads Gemma 4's rotary settings from rope_parameters only
    r.float("query_pre_attn_scalar", None, positive=True, null=None)  # typed only: transformers 5 does not read it
    act = r.require("hidden_activation", tuple(GELU_ACTIVATIONS), "gelu_pytorch_tanh")
    n_layers = r.n_layers("num_hidden_layers")
    d_model, n_heads = _heads(r, "hidden_size", "num_attention_heads", must_divide=False)
    d_head = _head_dim(r, d_model, n_heads, 256, null_derives=False)
    n_kv = _kv_heads(r, n_heads, 4, null_derives=False)
    windows = sliding_windows(r, n_layers, 6, 512)
    types = windows["layer_types"][:-1] + ("full",)  # transformers 5 makes the last block full, whatever the config says
    k_is_v = r.bool("attention_k_eq_v", False)
    full_d_head, full_n_kv = _gemma4_full_heads(r, types, d_head, n_kv, k_is_v)
    bias = r.bool("attention_bias", False)
    return {
        **_common(r, bos=2, eos=1),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "d_head": d_head, "n_kv_heads": n_kv,
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", 1e-6, positive=True), "norm": "rmsnorm", "mlp": "geglu", "activation": act,
        "norm_placement": "sandwich", "scale_embed": True, "tie_word_embeddings": r.bool("tie_word_embeddings", True),
        "fused_qkv": False, "qkv_bias": bias, "out_bias": bias, "mlp_bias": False, "query_pre_attn_scalar": 1.0,
        "qk_norm": True, "v_norm": True, "layer_scalar": True, "layer_types": types,
        "sliding_window": windows["sliding_window"] if "sliding" in types else None,
        "full_d_head": full_d_head, "full_n_kv_heads": full_n_kv, "full_k_is_v": k_is_v and "full" in types,
        "final_softcap": _cap(r, "final_logit_softcapping", None), **gemma4_rope(r, d_head),
        **gemma4_extras(r, n_layers, types),
    }


def _gemma4_full_heads(r: ConfigReader, types: tuple[str, ...], d_head: int, n_kv: int,
                       k_is_v: bool) -> tuple[int | None, int | None]:
    """The full blocks' head width and kv heads, None where they are the sliding blocks': from `per_layer_config`
    (how transformers 5 writes them: layer index -> overrides, which must be the same for every full block and
    absent for the others), else `global_head_dim` (512 when absent) and `num_global_key_value_heads` (read only
    with attention_k_eq_v, as transformers reads it)."""
    per_layer = r.d.get("per_layer_config")
    full = [i for i, t in enumerate(types) if t == "full"]
    if per_layer is None:
        width = r.int("global_head_dim", 512)
        heads = r.int("num_global_key_value_heads", None)
        heads = heads if k_is_v else None
    else:
        if not isinstance(per_layer, dict):
            raise ValueError(f"config field per_layer_config={per_layer!r:.80} must be an object (model_type={r.family!r})")
        keys = {k: int(k) if isinstance(k, str) and k.isdigit() else k for k in per_layer}  # transformers writes "05"
        given = {keys[k]: v for k, v in per_layer.items()}
        firsts = [given.get(i) for i in full]
        first = firsts[0] if firsts else {}
        if (set(given) - set(full) or any(f != first for f in firsts) or not isinstance(first, dict)
                or set(first) - {"head_dim", "num_key_value_heads"}):
            raise ValueError(f"config field per_layer_config={per_layer!r:.120}: lenskit implements the same head_dim and "
                             f"num_key_value_heads overrides on every full_attention block ({full}) and none elsewhere "
                             f"(model_type={r.family!r})")
        sub = ConfigReader(first, r.family, where="per_layer_config.")
        width, heads = sub.int("head_dim", None), sub.int("num_key_value_heads", None)
    if not full:
        return None, None
    if heads is not None and r.d.get("num_attention_heads", 0) % heads:
        raise ValueError(f"config field num_global_key_value_heads={heads} must divide num_attention_heads="
                         f"{r.d.get('num_attention_heads')} (model_type={r.family!r}); fix config.json")
    return (None if width in (None, d_head) else width), (None if heads in (None, n_kv) else heads)


def read_olmo2(r: ConfigReader) -> dict[str, Any]:
    bias = r.bool("attention_bias", False)
    return {**llama_like(r, bias, bias, False, eps=1e-5, bos=None, eos=50279), "qk_norm": True, "qk_norm_per_head": False,
            "norm_placement": "post"}


def read_olmo3(r: ConfigReader) -> dict[str, Any]:
    """OLMo 2's block with sliding-window blocks (three in four by default) and rotary settings per layer type."""
    bias = r.bool("attention_bias", False)
    fields = llama_like(r, bias, bias, False, eps=1e-5, bos=None, eos=50279, rotary=olmo3_rope)
    return {**fields, **sliding_windows(r, fields["n_layers"], 4, 4096), "qk_norm": True, "qk_norm_per_head": False,
            "norm_placement": "post"}


def _nope_layers(r: ConfigReader, n_layers: int) -> tuple[int, ...]:
    """SmolLM3's blocks without rotary: `no_rope_layers` (1: the block rotates, 0: it does not, one per block; more
    entries are never read), or every `no_rope_layer_interval`-th block without."""
    flags = r.d.get("no_rope_layers")
    interval = r.int("no_rope_layer_interval", 4)
    if flags is None:
        return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) < n_layers or any(type(f) is not int or f not in (0, 1) for f in flags):
        raise ValueError(f"config field no_rope_layers={flags!r} must list 1 (rotary) or 0 (none) for each of the "
                         f"{n_layers} layers (model_type={r.family!r})")
    return tuple(i for i in range(n_layers) if not flags[i])


def read_smollm3(r: ConfigReader) -> dict[str, Any]:
    """Llama with no rotary in some blocks (every fourth by default); with `use_sliding_window`, those blocks are the
    sliding-window ones. A block is sliding where `layer_types` says so, as transformers' masks make it."""
    bias = r.bool("attention_bias", False)
    fields = llama_like(r, bias, bias, r.bool("mlp_bias", False), eps=1e-6, bos=128000, eos=128001, kv_heads=4,
                         rope_types=ROPE_TYPES + ("yarn",), default_theta=2_000_000.0)  # YaRN: its card's long context
    n = fields["n_layers"]
    nope = _nope_layers(r, n)
    use_window, window = r.bool("use_sliding_window", False), r.int("sliding_window", None)
    if r.d.get("layer_types") is None:
        types = tuple("sliding" if use_window and window is not None and i in nope else "full" for i in range(n))
    else:
        types = _layer_types(r, n, pattern=1)
    if "sliding" in types and window is None:
        raise ValueError("config field sliding_window=None, but layer_types has sliding-window blocks; give the window "
                         f"(model_type={r.family!r})")
    sliding = "sliding" in types
    return {**fields, "tie_word_embeddings": r.bool("tie_word_embeddings", True), "nope_layers": nope,
            "layer_types": types if sliding else None, "sliding_window": window if sliding else None}


def read_phi3(r: ConfigReader) -> dict[str, Any]:
    r.int("original_max_position_embeddings", 4096)  # typed only: it matters to longrope scaling, which is refused
    # transformers 5's Phi-3 accepts only plain and longrope rotary; lenskit implements the plain one
    return {**llama_like(r, False, False, False, eps=1e-5, bos=1, eos=32000, rope_types=("default",)),
            "fused_qkv": True, "mlp": "swiglu_fused", "sliding_window": r.int("sliding_window", None)}


def read_config(d: Mapping[str, Any], model_type: str, read: Callable[[ConfigReader], dict[str, Any]],
                n_blocks: int | None = None) -> dict[str, Any]:
    """`ModelConfig` keyword arguments for the config dict `d` of `model_type`, read by the family's `read`.
    `n_blocks`: the number of blocks the checkpoint's tensor names hold, when known (see `ConfigReader`)."""
    r = ConfigReader(d, model_type, n_blocks)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        r.float(key, 0.0)  # typed only: dropout is off at inference and lenskit's own `dropout` governs training
    check_family_quantization(d, model_type)  # MXFP4 (gpt-oss) is dequantized on load; any other method is refused
    return read(r)

"""What the family readers share: reading a Hugging Face `config.json` into `ModelConfig` fields.

A family's own reader is its module's `read` (`lenskit.families.llama.read`): it reads the fields it implements with
strict types (`fields.ConfigReader`; the rotary ones through `rope.py`) and refuses, by name, any field whose value
would make the checkpoint compute something lenskit does not implement. Here are the pieces several readers use
(heads, the Llama-like and Gemma-like fields, sliding windows, routed experts) and `read_config`, which runs a
family's reader on a dict. Readers return plain dicts of `ModelConfig` keyword arguments, so this module imports
only config's constants; `writers.py` is the way back.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..config import GELU_ACTIVATIONS, ROPE_TYPES
from ..io.mxfp4 import check_family_quantization
from .fields import HF_LAYER_TYPES, REFUSED, ConfigReader
from .rope import rope


def read_heads(r: ConfigReader, d_model_key: str, heads_key: str, *, must_divide: bool) -> tuple[int, int]:
    """d_model and n_heads; `must_divide`: transformers refuses a d_model that n_heads does not divide, even with an
    explicit head_dim (GPT-2, GPT-NeoX, Llama, Gemma)."""
    d_model, n_heads = r.int(d_model_key), r.int(heads_key)
    if must_divide and d_model % n_heads:
        raise ValueError(f"config fields {d_model_key}={d_model} and {heads_key}={n_heads}: {heads_key} must divide "
                         f"{d_model_key} for model_type={r.family!r} (transformers refuses it too); fix config.json")
    return d_model, n_heads


def read_kv_heads(r: ConfigReader, n_heads: int, default: int | None, null_derives: bool = True) -> int:
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


def read_head_dim(r: ConfigReader, d_model: int, n_heads: int, default: int | None, null_derives: bool = True) -> int:
    """head_dim: absent is the family's default (None: d_model // n_heads); null derives where transformers does."""
    d_head = r.int("head_dim", default, null=None if null_derives else REFUSED)
    return d_model // n_heads if d_head is None else d_head


def common_fields(r: ConfigReader, bos: int | None, eos: int | None) -> dict[str, Any]:
    """The fields every family has; `bos` and `eos` are the family's default token ids."""
    return {
        "family": r.family,
        "bos_token_id": r.token_id("bos_token_id", bos),
        "eos_token_id": r.token_id("eos_token_id", eos),
        "initializer_range": r.float("initializer_range", 0.02),
    }


def llama_like(r: ConfigReader, qkv_bias: bool, out_bias: bool, mlp_bias: bool, *, eps: float, bos: int | None,
               eos: int | None, kv_heads: int | None = None, head_dim: int | None = None, null_head_dim: bool = True,
               null_kv_heads: bool = True, must_divide: bool = False, rope_types: tuple[str, ...] = ROPE_TYPES,
               rotary: Callable[[ConfigReader, int], dict[str, Any]] | None = None, act: str = "silu", **rope_defaults: Any) -> dict[str, Any]:
    """What the SwiGLU families share. The keywords are the family's transformers defaults: `kv_heads` and `head_dim`
    None derive (n_heads; d_model // n_heads); `null_*`: whether an explicit null derives too or is refused;
    `rope_defaults` go to `rope` (a family's own base and settings for absent rotary fields); `rotary`, where given,
    reads the rotary fields instead of `rope` (per-layer-type settings: OLMo 3)."""
    r.require("hidden_act", (act,), act)  # `act`: the one activation the family's MLP builds (Apertus's xielu)
    n_layers = r.n_layers("num_hidden_layers")
    d_model, n_heads = read_heads(r, "hidden_size", "num_attention_heads", must_divide=must_divide)
    d_head = read_head_dim(r, d_model, n_heads, head_dim, null_head_dim)
    return {
        **common_fields(r, bos, eos),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "d_head": d_head,
        "n_kv_heads": read_kv_heads(r, n_heads, kv_heads, null_kv_heads), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", eps, positive=True), "norm": "rmsnorm", "mlp": "swiglu",
        "tie_word_embeddings": r.bool("tie_word_embeddings", False), "fused_qkv": False,
        "qkv_bias": qkv_bias, "out_bias": out_bias, "mlp_bias": mlp_bias, **(rope(r, d_head, types=rope_types, **rope_defaults) if rotary is None else rotary(r, d_head)),
    }


def nope_layers(r: ConfigReader, n_layers: int) -> tuple[int, ...]:
    """The blocks without rotary (SmolLM3, Llama 4): `no_rope_layers` (1: the block rotates, 0: it does not, one per
    block; more entries are never read), or every `no_rope_layer_interval`-th block without."""
    flags = r.d.get("no_rope_layers")
    interval = r.int("no_rope_layer_interval", 4)
    if flags is None:
        return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) < n_layers or any(type(f) is not int or f not in (0, 1) for f in flags):
        raise ValueError(f"config field no_rope_layers={flags!r} must list 1 (rotary) or 0 (none) for each of the "
                         f"{n_layers} layers (model_type={r.family!r})")
    return tuple(i for i in range(n_layers) if not flags[i])


def no_qwen_sliding(r: ConfigReader) -> None:
    r.require("use_sliding_window", (False,), False)
    types = r.d.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise ValueError("config field layer_types has non-'full_attention' layers; lenskit implements only full attention for qwen")


def read_layer_types(r: ConfigReader, n_layers: int, pattern: int) -> tuple[str, ...]:
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
    types = read_layer_types(r, n_layers, pattern)
    window = r.int("sliding_window", window, null=None)
    if window is None and "sliding" in types:  # transformers would run its sliding blocks without a window
        raise ValueError(f"config field sliding_window=None, but layer_types has sliding-window blocks; give the window "
                         f"(model_type={r.family!r})")
    return {"layer_types": types, "sliding_window": window if "sliding" in types else None}


def gemma_like(r: ConfigReader, pattern: int) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share: (1 + w) RMSNorms before and after each sublayer, a scaled embedding,
    GELU-gated MLP, query_pre_attn_scalar, alternating sliding-window and global blocks."""
    r.require("use_bidirectional_attention", (False, None), False)
    act = r.require("hidden_activation", tuple(GELU_ACTIVATIONS), "gelu_pytorch_tanh")
    n_layers = r.n_layers("num_hidden_layers")  # before anything built per layer
    d_model, n_heads = read_heads(r, "hidden_size", "num_attention_heads", must_divide=True)
    bias = r.bool("attention_bias", False)
    return {
        **common_fields(r, bos=2, eos=1),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
        "d_head": read_head_dim(r, d_model, n_heads, 256, null_derives=False),
        "n_kv_heads": read_kv_heads(r, n_heads, 4, null_derives=False), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", 1e-6, positive=True), "norm": "rmsnorm_offset", "mlp": "geglu",
        "activation": act, "norm_placement": "sandwich", "scale_embed": True,
        "tie_word_embeddings": r.bool("tie_word_embeddings", True), "fused_qkv": False, "qkv_bias": bias,
        "out_bias": bias, "mlp_bias": False, "query_pre_attn_scalar": r.float("query_pre_attn_scalar", 256.0, positive=True),
        **sliding_windows(r, n_layers, pattern, 4096),
    }


def soft_cap(r: ConfigReader, key: str, default: float | None) -> float | None:
    """A soft-cap: absent means transformers' default for the family, an explicit null means no cap."""
    return r.float(key, default, positive=True, null=None)


_SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def qwen_dense_layers(r: ConfigReader, n_layers: int) -> tuple[int, ...]:
    """The dense blocks of a Qwen MoE (Qwen3-MoE, Qwen3-Next): those in `mlp_only_layers`, and all but every
    `decoder_sparse_step`-th block."""
    step = r.int("decoder_sparse_step", 1)
    only = r.d.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers
                                         for i in only):
        raise ValueError(f"config field mlp_only_layers={only!r} must list block indices in [0, {n_layers}) "
                         f"(model_type={r.family!r})")
    return tuple(i for i in range(n_layers) if i in only or (i + 1) % step)


def routed_experts(r: ConfigReader, key: str, alias: str, n: int, k: int, renorm: bool) -> dict[str, Any]:
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


def grouped_sigmoid_experts(r: ConfigReader, n_layers: int, *, n: int, d_expert: int, n_group: int, topk_group: int,
                            first_dense: int, scaling: float) -> dict[str, Any]:
    """DeepSeek V3's routed and shared experts (lenskit.pieces.shared_experts), as DeepSeek V3 and GLM-4.5 spell them:
    `n_routed_experts` (or `num_local_experts`, the alias both config classes map onto it), k of them per token among
    the `topk_group` best of `n_group` groups, `routed_scaling_factor`, `n_shared_experts`, and the first
    `first_k_dense_replace` blocks dense. The keywords are the family's transformers defaults."""
    n_experts = r.int("n_routed_experts", n)
    if "num_local_experts" in r.d and r.int("num_local_experts") != n_experts:
        raise ValueError(f"config fields n_routed_experts={n_experts} and num_local_experts={r.d['num_local_experts']!r} "
                         f"disagree: both spell the number of experts (model_type={r.family!r}); keep one of them")
    k = r.int("num_experts_per_tok", 8, null=REFUSED)
    if k > n_experts:
        raise ValueError(f"config field num_experts_per_tok={k} exceeds n_routed_experts={n_experts}: each token is "
                         f"routed to k of the experts (model_type={r.family!r}); fix config.json")
    n_group, topk_group = r.int("n_group", n_group, null=REFUSED), r.int("topk_group", topk_group, null=REFUSED)
    if n_experts % n_group or topk_group > n_group or topk_group * (n_experts // n_group) < k:
        raise ValueError(f"config fields n_routed_experts={n_experts}, n_group={n_group}, topk_group={topk_group} and "
                         f"num_experts_per_tok={k}: n_group must divide the experts, and the topk_group best groups must "
                         f"hold at least num_experts_per_tok experts (model_type={r.family!r}); fix config.json")
    first_dense = r.int("first_k_dense_replace", first_dense, positive=False, null=REFUSED)
    r.int("num_nextn_predict_layers", 1, positive=False)  # typed only: the MTP block transformers does not build
    r.int("num_mtp_layers", 1, positive=False)
    return {
        "n_experts": n_experts, "n_experts_per_token": k, "d_expert": r.int("moe_intermediate_size", d_expert),
        "routing": "sigmoid_group_topk_renorm" if r.bool("norm_topk_prob", True) else "sigmoid_group_topk",
        "n_group": n_group, "topk_group": topk_group,
        "routed_scaling_factor": r.float("routed_scaling_factor", scaling, positive=True),
        "n_shared_experts": r.int("n_shared_experts", 1, positive=False),
        "dense_layers": tuple(range(min(first_dense, n_layers))),
    }


def rotary_base_default(r: ConfigReader, fields: dict[str, Any], theta: float) -> dict[str, Any]:
    """`fields` with the family's own rotary base where config.json gives none anywhere (Mixtral's is 1e6)."""
    given = r.d.get("rope_theta") is not None or any(
        isinstance(r.d.get(k), dict) and "rope_theta" in r.d[k] for k in ("rope_parameters", "rope_scaling"))
    return fields if given else {**fields, "rotary_base": theta}


def read_config(d: Mapping[str, Any], model_type: str, read: Callable[[ConfigReader], dict[str, Any]],
                n_blocks: int | None = None) -> dict[str, Any]:
    """`ModelConfig` keyword arguments for the config dict `d` of `model_type`, read by the family's `read`.
    `n_blocks`: the number of blocks the checkpoint's tensor names hold, when known (see `ConfigReader`)."""
    r = ConfigReader(d, model_type, n_blocks)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        r.float(key, 0.0)  # typed only: dropout is off at inference and lenskit's own `dropout` governs training
    check_family_quantization(d, model_type)  # MXFP4 (gpt-oss) is dequantized on load; any other method is refused
    return read(r)

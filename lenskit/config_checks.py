"""`ModelConfig`'s checks of the newer architectures' fields, called from its `__post_init__`: Gemma 4's full
blocks, Qwen 3.5's linear-attention blocks, and the mixtures of experts. Each refuses a value by field name."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

# lenskit.config imports this module, so `cfg` here is typed Any: always a ModelConfig in the middle of its checks.
ModelConfig = Any

# How a Mamba-2 mixer's scan output y meets its gate z (lenskit.pieces.mamba2): RMS-normalise y * SiLU(z) per group
# (Nemotron-H, Granite 4, Falcon-H1's norm_before_gate=False), normalise y then times SiLU(z) (norm_before_gate=True),
# or no norm at all, y * SiLU(z) (Falcon-H1's mamba_rms_norm=False)
MAMBA_NORMS = ("gate_then_norm", "norm_then_gate", "gate_only")


def check_full_heads(cfg: "ModelConfig") -> None:
    """Gemma 4's fields: positive ints or None, whole heads turning where the full blocks' heads differ, a
    proportion in (0, 1]."""
    attention = cfg.attention
    for field, value in (("full_d_head", attention.full_d_head), ("full_n_kv_heads", attention.full_n_kv_heads)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"ModelConfig.{field} must be None or a positive int, got {value!r}")
    if attention.full_n_kv_heads is not None and cfg.n_heads % attention.full_n_kv_heads:
        raise ValueError(f"n_heads={cfg.n_heads} is not a multiple of full_n_kv_heads={attention.full_n_kv_heads}")
    if attention.full_d_head is not None and (attention.full_d_head % 2
                                              or (cfg.positional == "rotary" and cfg.rope.dim != cfg.d_head)):
        raise ValueError(f"ModelConfig.full_d_head={attention.full_d_head!r} needs an even width and whole heads turning "
                         f"(rotary_dim={cfg.rope.dim!r} == d_head={cfg.d_head}); lenskit implements no partial rotary there")
    value = cfg.rope.proportion
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"ModelConfig.rope_proportion must be in (0, 1], got {value!r}")
    if cfg.block.layer_scalar and (cfg.norm_placement != "sandwich" or cfg.parallel_block):
        raise ValueError("ModelConfig.layer_scalar is Gemma 4's sandwich block; it needs norm_placement='sandwich' "
                         "and parallel_block=False")
    if cfg.rope.type != "proportional" and value != 1.0:
        raise ValueError(f"ModelConfig.rope_proportion={value!r} is a proportional-rotary setting; rope_type="
                         f"{cfg.rope.type!r} turns every pair, so leave it 1.0")

@lru_cache(maxsize=32)
def kv_sources(n_layers: int, n_shared: int, layer_types: tuple[str, ...] | None) -> tuple[int | None, ...]:
    """Per block, the block whose keys and values it reads, or None: blocks from n_layers - n_shared on read the last
    block before them of their own layer type (None there too where no earlier block has that type)."""
    first = n_layers - n_shared
    last: dict[str | None, int] = {}
    for i in range(first):
        last[None if layer_types is None else layer_types[i]] = i
    return tuple(None if i < first else last.get(None if layer_types is None else layer_types[i])
                 for i in range(n_layers))


def shrunk_kv_sharing(cfg: "ModelConfig", n_layers: int, layer_types: tuple[str, ...] | None) -> dict:
    """`ModelConfig.replace`'s rule for Gemma 4's kv sharing over `n_layers` blocks of `layer_types`: the same share
    of the blocks (rounded down), fewer where a sharing block's type would have no earlier block to read."""
    types = None if layer_types is None else tuple(layer_types)
    if not isinstance(n_layers, int) or n_layers <= 0 or (types is not None and len(types) != n_layers):
        return {}  # __post_init__ refuses the depth or the types
    shared = cfg.block.n_kv_shared_layers * n_layers // cfg.n_layers
    while shared and None in kv_sources(n_layers, shared, types)[n_layers - shared:]:
        shared -= 1
    return {"n_kv_shared_layers": shared, "double_wide_mlp": cfg.block.double_wide_mlp and shared > 0}


def _positive_or_none(field: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"ModelConfig.{field} must be None or a positive int, got {value!r}")


def check_llama4_attention(cfg: "ModelConfig") -> None:
    """Llama 4's attention pieces (lenskit.pieces.attention): a chunk size where blocks are "chunked", a
    positive temperature floor or none, a finite temperature scale, one kind of q/k norm, and pairs of dims that turn
    together only where the whole head turns."""
    attention = cfg.attention
    _positive_or_none("attn_chunk_size", attention.chunk_size)
    if cfg.layer_types is not None and "chunked" in cfg.layer_types and attention.chunk_size is None:
        raise ValueError("ModelConfig.layer_types has 'chunked' blocks but attn_chunk_size is None; give the chunk size")
    _positive_or_none("attn_temperature_floor", attention.temperature_floor)
    scale = attention.temperature_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"ModelConfig.attn_temperature_scale must be a finite number, got {scale!r}")
    if attention.qk_unit_norm and attention.qk_norm:
        raise ValueError("ModelConfig.qk_unit_norm and qk_norm are two q/k norms (without a gain, and with one); "
                         "a model has at most one: unset one of them")
    if cfg.rope.adjacent_pairs and (cfg.positional != "rotary" or cfg.rope.dim != cfg.d_head):
        raise ValueError(f"ModelConfig.rope_adjacent_pairs turns whole heads (Llama 4's), but positional="
                         f"{cfg.positional!r} and rotary_dim={cfg.rope.dim!r} of d_head={cfg.d_head}; unset it")


def check_gemma4_extras(cfg: "ModelConfig") -> None:
    """Gemma 4's per-layer inputs, kv sharing and experts beside the MLP: well-typed, each block able to find what it
    reads, and each piece where Gemma 4's block (`layer_scalar`) puts it."""
    block = cfg.block
    _positive_or_none("d_per_layer", block.d_per_layer)
    _positive_or_none("d_vocab_per_layer", block.d_vocab_per_layer)
    if block.d_per_layer is None and block.d_vocab_per_layer is not None:
        raise ValueError(f"ModelConfig.d_vocab_per_layer={block.d_vocab_per_layer!r} is the per-layer inputs' vocabulary, "
                         "but d_per_layer is None (there are none); leave it None")
    if block.d_per_layer is not None and block.d_vocab_per_layer < cfg.d_vocab:
        raise ValueError(f"ModelConfig.d_vocab_per_layer={block.d_vocab_per_layer} is below d_vocab={cfg.d_vocab}: "
                         "a token past it would have no per-layer input; give at least d_vocab")
    n = block.n_kv_shared_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < cfg.n_layers:
        raise ValueError(f"ModelConfig.n_kv_shared_layers must be an int in [0, n_layers={cfg.n_layers}) (some earlier "
                         f"block must compute the keys the others read), got {n!r}")
    if n:
        shared = range(cfg.n_layers - n, cfg.n_layers)
        if any(cfg.layer_type(i) == "linear" for i in range(cfg.n_layers)):
            raise ValueError("ModelConfig.n_kv_shared_layers needs softmax-attention blocks only; this config has "
                             "linear-attention blocks")
        orphan = next((i for i in shared if cfg.kv_source(i) is None), None)
        if orphan is not None:
            raise ValueError(f"ModelConfig.n_kv_shared_layers={n}: block {orphan} ({cfg.layer_type(orphan)!r}) reads the "
                             f"keys of the last earlier block of its type, but blocks 0..{cfg.n_layers - n - 1} have none "
                             "(transformers refuses it too); share fewer blocks or change layer_types")
    if block.double_wide_mlp and not n:
        raise ValueError("ModelConfig.double_wide_mlp widens the kv-sharing blocks' MLPs, but n_kv_shared_layers=0; "
                         "leave it False")
    gemma4 = block.layer_scalar and cfg.norm_placement == "sandwich"
    for field, on in (("d_per_layer", block.d_per_layer is not None), ("experts_beside_mlp", block.experts_beside_mlp)):
        if on and not gemma4:
            raise ValueError(f"ModelConfig.{field} is a piece of Gemma 4's block; it needs layer_scalar=True and "
                             "norm_placement='sandwich'")
    moe = cfg.moe
    if block.experts_beside_mlp and (moe.n_experts is None or moe.dense_layers or moe.router_bias or cfg.mlp != "geglu"
                                     or moe.routing != "softmax_topk_renorm"):
        raise ValueError("ModelConfig.experts_beside_mlp is Gemma 4's: it needs n_experts, mlp='geglu', "
                         "routing='softmax_topk_renorm', no dense_layers and no router_bias")


def check_linear(cfg: "ModelConfig") -> None:
    """The linear-attention fields, where layer_types has a "linear" block: positive ints, v heads a multiple of
    k heads. (Without one they are unused; a one-block copy of a hybrid model keeps them.)"""
    linear = cfg.linear
    if cfg.layer_types is None or "linear" not in cfg.layer_types:
        return
    for field, value in (("linear_n_k_heads", linear.n_k_heads), ("linear_n_v_heads", linear.n_v_heads),
                         ("linear_d_k", linear.d_k), ("linear_d_v", linear.d_v), ("linear_conv_width", linear.conv_width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"ModelConfig.{field} must be a positive int for linear-attention blocks, got {value!r}")
    if linear.n_v_heads % linear.n_k_heads:
        raise ValueError(f"ModelConfig.linear_n_v_heads={linear.n_v_heads} is not a multiple of linear_n_k_heads="
                         f"{linear.n_k_heads}: each q/k head serves a whole group of value heads")

def check_mamba(cfg: "ModelConfig") -> None:
    """The Mamba-2 fields, where layer_types has a "mamba" block: positive widths, heads a multiple of the groups,
    an ordered step-size range, a known norm, five finite multipliers. (Without one they are unused.)"""
    mamba = cfg.mamba
    if not cfg.block.mamba_beside_attention and (cfg.layer_types is None or "mamba" not in cfg.layer_types):
        return
    for field, value in (("mamba_n_heads", mamba.n_heads), ("mamba_d_head", mamba.d_head),
                         ("mamba_d_state", mamba.d_state), ("mamba_n_groups", mamba.n_groups),
                         ("mamba_conv_width", mamba.conv_width), ("mamba_chunk_size", mamba.chunk_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"ModelConfig.{field} must be a positive int for Mamba-2 blocks, got {value!r}")
    if mamba.n_heads % mamba.n_groups:
        raise ValueError(f"ModelConfig.mamba_n_heads={mamba.n_heads} is not a multiple of mamba_n_groups="
                         f"{mamba.n_groups}: each group's B and C serve a whole run of heads")
    for field, value in (("mamba_dt_min", mamba.dt_min), ("mamba_dt_max", mamba.dt_max)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"ModelConfig.{field} must be a number >= 0 (inf allowed for dt_max), got {value!r}")
    if not mamba.dt_min <= mamba.dt_max or mamba.dt_min == float("inf"):
        raise ValueError(f"ModelConfig.mamba_dt_min={mamba.dt_min!r} must be finite and <= mamba_dt_max={mamba.dt_max!r}")
    if mamba.norm not in MAMBA_NORMS:
        raise ValueError(f"ModelConfig.mamba_norm={mamba.norm!r}; supported: {MAMBA_NORMS}")
    multipliers = mamba.multipliers
    if not isinstance(multipliers, tuple) or len(multipliers) != 5 or any(
            isinstance(m, bool) or not isinstance(m, (int, float)) or not abs(m) < float("inf")
            for m in (*multipliers, mamba.in_multiplier, mamba.out_multiplier)):
        raise ValueError(f"ModelConfig.mamba_multipliers must be a tuple of 5 finite numbers (z, x, B, C, dt) and "
                         f"mamba_in_multiplier, mamba_out_multiplier finite numbers, got {multipliers!r}, "
                         f"{mamba.in_multiplier!r}, {mamba.out_multiplier!r}")


def check_experts(cfg: "ModelConfig") -> None:
    """The MoE fields: all unset for a dense model; else n_experts >= k >= 1, blocks in range. (ModelConfig checks the
    routing rule against ROUTINGS.)"""
    moe = cfg.moe
    if moe.n_experts is None:
        if moe.n_experts_per_token is not None or moe.d_expert is not None or moe.dense_layers or moe.router_bias:
            raise ValueError("ModelConfig.n_experts is None (a dense model), so n_experts_per_token, d_expert, "
                             "dense_layers and router_bias must be unset; give n_experts for a mixture of experts")
        if cfg.mlp == "swiglu_clamped":
            raise ValueError("ModelConfig.mlp='swiglu_clamped' is an expert piece (gpt-oss); give n_experts, or "
                             "choose a dense MLP")
        return
    for field, value in (("n_experts", moe.n_experts), ("n_experts_per_token", moe.n_experts_per_token),
                         ("d_expert", moe.d_expert)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"ModelConfig.{field} must be a positive int for a mixture of experts, got {value!r}")
    if moe.n_experts_per_token > moe.n_experts:
        raise ValueError(f"ModelConfig.n_experts_per_token={moe.n_experts_per_token} exceeds n_experts="
                         f"{moe.n_experts}: each token is routed to k of the experts; lower k")
    if cfg.mlp == "swiglu_clamped" and moe.dense_layers:
        raise ValueError(f"ModelConfig.mlp='swiglu_clamped' is an expert piece only, but dense_layers="
                         f"{moe.dense_layers!r} asks for dense blocks; leave dense_layers empty")
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.n_layers for i in moe.dense_layers) \
            or list(moe.dense_layers) != sorted(set(moe.dense_layers)):
        raise ValueError(f"ModelConfig.dense_layers={moe.dense_layers!r} must be increasing block indices in "
                         f"[0, {cfg.n_layers})")
    check_grouped_routing(cfg)


def check_grouped_routing(cfg: "ModelConfig") -> None:
    """DeepSeek V3's routing and shared experts (lenskit.pieces.shared_experts): whole groups of at least two experts
    (a group's score is its best two), topk_group of them holding at least k experts, and each setting only where the
    routing rule reads it."""
    moe = cfg.moe
    for field, value, low in (("n_group", moe.n_group, 1), ("topk_group", moe.topk_group, 1),
                              ("n_shared_experts", moe.n_shared_experts, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"ModelConfig.{field} must be an int >= {low}, got {value!r}")
    check_shared_expert(cfg)
    if not moe.routing.startswith("sigmoid_group_topk"):
        shared = moe.routing == "sigmoid_topk"  # Llama 4's routing has a shared expert beside the routed ones
        changed = [f for f, v, default in (("n_group", moe.n_group, 1), ("topk_group", moe.topk_group, 1),
                                           ("routed_scaling_factor", moe.routed_scaling_factor, 1.0)) if v != default]
        if changed:
            raise ValueError(f"ModelConfig.{changed[0]} is a setting of DeepSeek's routing; routing={moe.routing!r} does "
                             "not read it: use routing='sigmoid_group_topk' (or '_renorm'), or leave it at its default")
        if shared and cfg.mlp != "swiglu":
            raise ValueError(f"ModelConfig.routing='sigmoid_topk' is Llama 4's, whose experts are SwiGLU; got "
                             f"mlp={cfg.mlp!r}: use mlp='swiglu'")
        return
    if moe.n_experts % moe.n_group or moe.n_experts // moe.n_group < 2:
        raise ValueError(f"ModelConfig.n_group={moe.n_group} must divide n_experts={moe.n_experts} into groups of at "
                         "least 2 experts (a group scores by its best two); choose another n_group")
    if moe.topk_group > moe.n_group or moe.topk_group * (moe.n_experts // moe.n_group) < moe.n_experts_per_token:
        raise ValueError(f"ModelConfig.topk_group={moe.topk_group} must be <= n_group={moe.n_group} and its groups must "
                         f"hold at least n_experts_per_token={moe.n_experts_per_token} experts; raise topk_group or lower k")
    if cfg.mlp not in ("swiglu", "gelu"):  # DeepSeek's SwiGLU experts, Nemotron-H's ungated squared-ReLU ones
        raise ValueError(f"ModelConfig.routing={moe.routing!r} is DeepSeek V3's (and Nemotron-H's), whose experts are "
                         f"SwiGLU (or ungated); got mlp={cfg.mlp!r}: use mlp='swiglu' or 'gelu'")


def check_shared_expert(cfg: "ModelConfig") -> None:
    """The shared experts' width and gate (lenskit.pieces.shared_experts): set only where there are shared experts, and
    those of SwiGLU experts (the shared MLP is a SwiGLU one)."""
    moe = cfg.moe
    _positive_or_none("d_shared_expert", moe.d_shared)
    if not moe.n_shared_experts and (moe.d_shared is not None or moe.shared_gate):
        raise ValueError("ModelConfig.n_shared_experts is 0, so d_shared_expert and shared_expert_gate must be unset; "
                         "give n_shared_experts for a shared expert")
    if moe.n_shared_experts and cfg.mlp not in ("swiglu", "swiglu_fused", "gelu"):
        raise ValueError(f"ModelConfig.n_shared_experts={moe.n_shared_experts}: lenskit's shared experts are dense MLPs "
                         f"of the experts' kind, SwiGLU (Granite's fused) or ungated (Nemotron-H's); got mlp={cfg.mlp!r}: "
                         "use mlp='swiglu', 'swiglu_fused' or 'gelu'")


def check_latent_attention(cfg: "ModelConfig") -> None:
    """Multi-head latent attention's widths (lenskit.pieces.latent_attention): positive ints where kv_lora_rank is set,
    all unset without it, and rotary positions (its keys' rotated part is the only place a position enters)."""
    mla = cfg.mla
    if mla.kv_lora_rank is None:
        if mla.q_lora_rank is not None or mla.qk_nope_head_dim is not None:
            raise ValueError("ModelConfig.kv_lora_rank is None (no latent attention), so q_lora_rank and qk_nope_head_dim "
                             "must be None; give kv_lora_rank for latent attention")
        return
    _positive_or_none("kv_lora_rank", mla.kv_lora_rank)
    _positive_or_none("q_lora_rank", mla.q_lora_rank)
    if not isinstance(mla.qk_nope_head_dim, int) or isinstance(mla.qk_nope_head_dim, bool) or mla.qk_nope_head_dim < 0:
        raise ValueError(f"ModelConfig.qk_nope_head_dim must be an int >= 0 for latent attention, got {mla.qk_nope_head_dim!r}")
    if cfg.positional != "rotary" or cfg.nope_layers or cfg.n_kv_heads != cfg.n_heads:
        raise ValueError("ModelConfig.kv_lora_rank (latent attention) needs positional='rotary', no nope_layers and "
                         f"n_kv_heads == n_heads (every head expands the latent); got positional={cfg.positional!r}, "
                         f"nope_layers={cfg.nope_layers!r}, n_kv_heads={cfg.n_kv_heads}")
    unsupported = [name for name, on in (("qk_norm", cfg.attention.qk_norm), ("attn_softcap", cfg.attention.softcap),
                                         ("attn_sinks", cfg.attention.sinks), ("attn_output_gate", cfg.attention.output_gate),
                                         ("v_norm", cfg.attention.v_norm), ("sliding_window", cfg.sliding_window),
                                         ("n_kv_shared_layers", cfg.block.n_kv_shared_layers))
                   if on not in (None, False, 0)]
    if unsupported:
        raise ValueError(f"ModelConfig.{unsupported[0]} is not implemented with latent attention (kv_lora_rank); "
                         "leave it unset")



def check_scales(cfg: "ModelConfig") -> None:
    """The muP multipliers (`cfg.scales`, Granite's and Falcon-H1's) only where a piece applies them: attention's on three separate q, k,
    v projections (lenskit.pieces.qkv.ScaledSplitQKV; not fused, gated, latent or kv-sharing ones), the MLP's on a
    dense SwiGLU (lenskit.pieces.mlp.ScaledSwiGLU). A multiplier no piece reads is refused rather than ignored."""
    scales = cfg.scales
    if scales.residual != 1.0:  # Granite's: the output projections of attention, the MLPs, experts and Mamba-2 apply it
        odd = [name for name, on in (("kv_lora_rank", cfg.mla.kv_lora_rank is not None),
                                     ("layer_types 'linear'", "linear" in (cfg.layer_types or ())),
                                     ("d_per_layer", cfg.block.d_per_layer is not None)) if on]
        if odd:
            raise ValueError(f"ModelConfig.residual_multiplier={scales.residual!r} scales the writes of attention, MLPs, "
                             f"experts and Mamba-2 mixers (Granite's), but this config sets {odd[0]}, whose write has no "
                             "such scale; leave it at 1.0")
    if scales.attention_in != 1.0 or scales.key != 1.0:
        odd = [name for name, on in (("fused_qkv", cfg.attention.fused_qkv), ("attn_output_gate", cfg.attention.output_gate),
                                     ("kv_lora_rank", cfg.mla.kv_lora_rank is not None),
                                     ("n_kv_shared_layers", cfg.block.n_kv_shared_layers > 0),
                                     ("full_k_is_v", cfg.attention.full_k_is_v)) if on]
        if odd:
            raise ValueError(f"ModelConfig.attention_in_multiplier / key_multiplier apply to three separate q, k, v "
                             f"projections (Falcon-H1's), but this config sets {odd[0]}; leave the multipliers at 1.0")
    if (scales.mlp_gate != 1.0 or scales.mlp_down != 1.0) and (cfg.mlp != "swiglu" or cfg.moe.n_experts is not None):
        raise ValueError(f"ModelConfig.mlp_gate_multiplier / mlp_down_multiplier apply to a dense SwiGLU MLP (Falcon-H1's), "
                         f"got mlp={cfg.mlp!r}{' with experts' if cfg.moe.n_experts is not None else ''}; leave them at 1.0")

"""Nemotron-H (`nemotron_h`; 8B, 47B, 56B): each of transformers' layers is one pre-norm sublayer with a residual, a
Mamba-2 mixer ("M", lenskit.pieces.mamba2), softmax attention without positions ("*") or a squared-ReLU MLP ("-"),
as `hybrid_override_pattern` (transformers 5: `layers_block_type`) lists them. Each layer is one lenskit block
(`block.one_sublayer`, lenskit.pieces.layers.OneSublayerBlock) whose other half is absent and writes zeros, so every
block's resid_post is that layer's output. The MoE layers ("E", as Nemotron 3 Nano's) are MLP-only blocks whose MLP
is routed squared-ReLU experts, chosen by DeepSeek's grouped sigmoid rule, beside one shared squared-ReLU MLP
(lenskit.pieces.shared_experts); a latent projection around the experts (moe_latent_size) is refused by name."""

from __future__ import annotations

import math
import re
from typing import Any, Iterator

import torch

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import REFUSED, ConfigReader
from .layouts import FusedExperts, Layout
from .presets import named_presets
from .readers import common_fields

# transformers' layer kinds and the pattern letters of the published configs -> ModelConfig.layer_types
_KINDS = {"linear_attention": "mamba", "full_attention": "full", "mlp": "mlp", "moe": "mlp"}  # moe: a sparse MLP block
_LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_TO_HF = {"mamba": "linear_attention", "full": "full_attention", "mlp": "mlp"}
# transformers' spellings from the remote-code configs, which its config class renames on reading
_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
           "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}


def _layer_kinds(r: ConfigReader) -> list[str]:
    """transformers' layer kinds: `layers_block_type` (or its alias `layer_types`), else `hybrid_override_pattern`,
    else transformers' default."""
    kinds = r.d.get("layers_block_type", r.d.get("layer_types"))
    if kinds is None and "hybrid_override_pattern" in r.d:
        pattern = r.d["hybrid_override_pattern"]
        if not isinstance(pattern, str) or not pattern or any(c not in _LETTERS for c in pattern):
            raise ValueError(f"config field hybrid_override_pattern={pattern!r} must be a non-empty string of "
                             f"{sorted(_LETTERS)} (model_type={r.family!r}); fix config.json")
        kinds = [_LETTERS[c] for c in pattern]
    if kinds is None:
        kinds = ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
    if not isinstance(kinds, list) or not kinds or any(k not in _KINDS for k in kinds):
        raise ValueError(f"config field layers_block_type={kinds!r} must list one of {sorted(_KINDS)} per layer "
                         f"(model_type={r.family!r}); fix config.json")
    return kinds


def _step_limit(r: ConfigReader, key: str) -> tuple[float, float]:
    limit = r.d.get(key, (0.0, float("inf")))
    if (not isinstance(limit, (list, tuple)) or len(limit) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0 for v in limit)
            or not limit[0] <= limit[1]):
        raise ValueError(f"config field {key}={limit!r} must be [min, max] step sizes with 0 <= min <= max "
                         f"(model_type={r.family!r}); fix config.json")
    return float(limit[0]), float(limit[1])


def read(r: ConfigReader) -> dict[str, Any]:
    for legacy, name in _LEGACY.items():  # as transformers' config class renames them
        if legacy in r.d:
            if name in r.d and r.d[name] != r.d[legacy]:
                raise ValueError(f"config fields {legacy}={r.d[legacy]!r} and {name}={r.d[name]!r} disagree: both spell "
                                 f"one setting (model_type={r.family!r}); keep one of them")
            r = ConfigReader({**{k: v for k, v in r.d.items() if k != legacy}, name: r.d[legacy]}, r.family, r.n_blocks)
    r.require("mamba_hidden_act", ("silu",), "silu")
    r.require("mlp_hidden_act", ("relu2",), "relu2")
    kinds = _layer_kinds(r)
    n_layers = len(kinds)
    if r.n_blocks is not None and n_layers > r.n_blocks:
        raise ValueError(f"config field layers_block_type lists {n_layers} layers, but the checkpoint's tensor names hold "
                         f"{r.n_blocks} block(s); fix config.json or use the checkpoint it belongs to")
    d_head = r.int("head_dim", 128)
    if "attention_head_dim" in r.d and r.int("attention_head_dim") != d_head:  # the remote-code configs' spelling
        raise ValueError(f"config fields attention_head_dim={r.d['attention_head_dim']!r} and head_dim={d_head} disagree "
                         f"(model_type={r.family!r}); transformers reads head_dim: fix config.json")
    n_heads = r.int("num_attention_heads")
    n_kv = r.int("num_key_value_heads", 8, null=REFUSED)
    if n_heads % n_kv:
        raise ValueError(f"config fields num_attention_heads={n_heads} and num_key_value_heads={n_kv}: each kv head "
                         f"serves a whole group of query heads (model_type={r.family!r}); fix config.json")
    # typed only: what transformers' forward never reads (initialisation, kernels, training, the multi-token-prediction
    # layers it does not build, fields its attention and mixer ignore: attention_bias, sliding_window, mamba_proj_bias,
    # residual_in_fp32, rms_norm_eps), or reads only to round its cached state (mamba_ssm_cache_dtype)
    for key, default in (("time_step_min", 0.001), ("time_step_max", 0.1), ("time_step_floor", 1e-4)):
        r.float(key, default, null=REFUSED)
    for key in ("use_mamba_kernels", "rescale_prenorm_residual", "attention_bias", "mamba_proj_bias", "residual_in_fp32"):
        r.bool(key, False)
    r.int("sliding_window", None, null=None)
    # transformers' NemotronHForCausalLM never ties lm_head to the embedding (it has no tied-weights keys), whatever
    # tie_word_embeddings says: typed only, and the model untied as there
    r.bool("tie_word_embeddings", False)
    r.int("num_nextn_predict_layers", 0, positive=False)
    r.float("rms_norm_eps", None, null=None)
    n_mamba_heads = r.int("mamba_num_heads", 128)
    n_groups = r.int("n_groups", 8, null=REFUSED)
    if n_mamba_heads % n_groups:
        raise ValueError(f"config fields mamba_num_heads={n_mamba_heads} and n_groups={n_groups}: each group serves a run "
                         f"of heads, so n_groups must divide mamba_num_heads (model_type={r.family!r}); fix config.json")
    dt_min, dt_max = _step_limit(r, "time_step_limit")
    bias = r.bool("use_bias", False)
    moe = _experts(r, kinds) if "moe" in kinds else {}
    return {
        **moe,
        **common_fields(r, bos=1, eos=2),
        "n_layers": n_layers, "d_model": r.int("hidden_size"), "n_heads": n_heads, "n_kv_heads": n_kv, "d_head": d_head,
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("layer_norm_epsilon", 1e-5, positive=True), "norm": "rmsnorm", "mlp": "gelu",
        "activation": "relu2", "mlp_bias": r.bool("mlp_bias", False), "positional": "none",
        "tie_word_embeddings": False, "fused_qkv": False, "qkv_bias": False,
        "out_bias": False, "one_sublayer": True, "layer_types": tuple(_KINDS[k] for k in kinds),
        "mamba_n_heads": n_mamba_heads, "mamba_d_head": r.int("mamba_head_dim", 64),
        "mamba_d_state": r.int("ssm_state_size", 128), "mamba_n_groups": n_groups,
        "mamba_conv_width": r.int("conv_kernel", 4), "mamba_conv_bias": r.bool("use_conv_bias", True),
        "mamba_in_bias": bias, "mamba_out_bias": bias, "mamba_chunk_size": r.int("chunk_size", 128),
        "mamba_dt_min": dt_min, "mamba_dt_max": dt_max,
    }


def _experts(r: ConfigReader, kinds: list[str]) -> dict[str, Any]:
    """The MoE layers' fields: routed squared-ReLU experts chosen by sigmoid scores within the best groups (DeepSeek's
    rule, lenskit.pieces.shared_experts) and one shared squared-ReLU MLP; a latent projection around the experts
    (moe_latent_size) is refused by name."""
    if r.int("moe_latent_size", None, null=None) is not None:
        raise ValueError(f"config field moe_latent_size={r.d['moe_latent_size']!r}: the experts' latent projection is not "
                         f"implemented for model_type={r.family!r}; lenskit loads MoE layers without it (null)")
    r.bool("moe_shared_expert_overlap", True)  # typed only: a parallelism setting
    r.int("n_shared_experts", 1, positive=False)  # typed only: transformers builds one shared MLP whatever it says
    n_experts, k = r.int("n_routed_experts", 8), r.int("num_experts_per_tok", 2)
    n_group, topk_group = r.int("n_group", 1), r.int("topk_group", 1)
    if k > n_experts or n_experts % n_group or topk_group > n_group or topk_group * (n_experts // n_group) < k:
        raise ValueError(f"config fields n_routed_experts={n_experts}, n_group={n_group}, topk_group={topk_group} and "
                         f"num_experts_per_tok={k}: n_group must divide the experts, and the topk_group best groups must "
                         f"hold at least num_experts_per_tok experts (model_type={r.family!r}); fix config.json")
    return {"n_experts": n_experts, "n_experts_per_token": k, "d_expert": r.int("moe_intermediate_size", 7688),
            "routing": "sigmoid_group_topk_renorm" if r.bool("norm_topk_prob", True) else "sigmoid_group_topk",
            "n_group": n_group, "topk_group": topk_group,
            "routed_scaling_factor": r.float("routed_scaling_factor", 1.0, positive=True), "n_shared_experts": 1,
            "d_shared_expert": r.int("moe_shared_expert_intermediate_size", 7688),
            "dense_layers": tuple(i for i, kind in enumerate(kinds) if kind != "moe")}


def _hf_kind(cfg: ModelConfig, layer: int) -> str:
    return "moe" if cfg.layer_type(layer) == "mlp" and cfg.is_moe_layer(layer) else _TO_HF[cfg.layer_type(layer)]


def write(cfg: ModelConfig) -> dict[str, Any]:
    m, moe = cfg.mamba, cfg.moe
    experts = {} if moe.n_experts is None else {
        "n_routed_experts": moe.n_experts, "num_experts_per_tok": moe.n_experts_per_token,
        "moe_intermediate_size": moe.d_expert, "norm_topk_prob": moe.routing.endswith("_renorm"), "n_group": moe.n_group,
        "topk_group": moe.topk_group, "routed_scaling_factor": moe.routed_scaling_factor,
        "moe_shared_expert_intermediate_size": moe.d_shared, "moe_latent_size": None}
    return {
        **experts,
        **writers.common_fields(cfg), "pad_token_id": 0, "hidden_size": cfg.d_model,
        "layers_block_type": [_hf_kind(cfg, i) for i in range(cfg.n_layers)],
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
        "max_position_embeddings": cfg.n_ctx, "intermediate_size": cfg.d_mlp, "mlp_hidden_act": "relu2",
        "mlp_bias": cfg.mlp_bias, "layer_norm_epsilon": cfg.norm_eps, "mamba_hidden_act": "silu",
        "mamba_num_heads": m.n_heads, "mamba_head_dim": m.d_head, "ssm_state_size": m.d_state, "n_groups": m.n_groups,
        "conv_kernel": m.conv_width, "use_conv_bias": m.conv_bias, "use_bias": m.in_bias, "chunk_size": m.chunk_size,
        "time_step_limit": [m.dt_min, m.dt_max],
    }


_BLOCK = {
    # the one norm: before the mixer in a mixer-only block, before the MLP in an MLP-only one
    "ln1.weight": "norm.weight", "ln2.weight": "norm.weight",
    **{f"attn.{ours}": f"mixer.{theirs}" for ours, theirs in (
        ("in_proj.weight", "in_proj.weight"), ("in_proj.bias", "in_proj.bias"), ("conv_weight", "conv1d.weight"),
        ("conv_bias", "conv1d.bias"), ("dt_bias", "dt_bias"), ("A_log", "A_log"), ("D", "D"),
        ("norm.weight", "norm.weight"), ("out_proj.weight", "out_proj.weight"), ("out_proj.bias", "out_proj.bias"),
        ("qkv.q.weight", "q_proj.weight"), ("qkv.k.weight", "k_proj.weight"), ("qkv.v.weight", "v_proj.weight"),
        ("out.weight", "o_proj.weight"))},
    **{f"mlp.{part}{ours}.{p}": f"mixer.{hf_part}{theirs}.{p}" for ours, theirs in (("fc_in", "up_proj"), ("fc_out", "down_proj"))
       for p in ("weight", "bias") for part, hf_part in (("", ""), ("shared.", "shared_experts."))},
    # the MoE layers: the router and its correction bias, each routed expert's two projections
    "mlp.router.weight": "mixer.gate.weight", "mlp.e_score_correction_bias": "mixer.gate.e_score_correction_bias",
    **{f"mlp.experts.{{e}}.{ours}.weight": f"mixer.experts.{{e}}.{theirs}.weight"
       for ours, theirs in (("fc_in", "up_proj"), ("fc_out", "down_proj"))},
}


class UpDownExperts(FusedExperts):
    """transformers' in-memory Nemotron-H experts: `up_proj` [expert, d_expert, d_model] and `down_proj`
    [expert, d_model, d_expert], no gate."""

    def shapes(self, cfg) -> tuple[tuple[int, ...], ...]:
        return (cfg.moe.n_experts, cfg.moe.d_expert, cfg.d_model), (cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert)

    def parts(self, up: torch.Tensor, down: torch.Tensor, cfg) -> Iterator[tuple[int, str, torch.Tensor]]:
        for e in range(cfg.moe.n_experts):
            yield e, "fc_in", up[e]
            yield e, "fc_out", down[e]
_MTP = re.compile(r"mtp\.")


def _multi_token_prediction(name: str, cfg: ModelConfig) -> bool:
    """A published checkpoint's multi-token-prediction layers (`mtp.*`): transformers drops them on load."""
    return _MTP.match(name) is not None


# transformers saves the base model as `backbone.` (the published checkpoints' names) and holds it as `model.`
LAYOUT = Layout(prefix="backbone.", other_prefixes=("model.",), blocks="layers", block=_BLOCK,
                unread=_multi_token_prediction,
                fused=UpDownExperts(gate_up="mixer.experts.up_proj", down="mixer.experts.down_proj", router="mixer.gate.weight"),
                top={"embed.weight": "embeddings.weight", "ln_final.weight": "norm_f.weight",
                     "unembed.weight": "lm_head.weight"})


def pattern_types(pattern: str) -> tuple[str, ...]:
    """A published `hybrid_override_pattern` as ModelConfig.layer_types."""
    return tuple(_KINDS[_LETTERS[c]] for c in pattern)


def _preset(name: str, pattern: str, d_model: int, n_heads: int, d_mlp: int, n_mamba_heads: int, d_state: int,
            n_ctx: int) -> ModelConfig:
    """Nemotron-H's shape (nvidia/Nemotron-H-*-Base-8K's config.json, as recalled): attention heads of 128 with 8 kv
    heads and no positions, Mamba-2 heads of 64 in 8 groups with a kernel of 4 and chunks of 128, squared-ReLU MLPs,
    RMSNorms (eps 1e-5), no biases but the convolution's, a 131,072-token vocabulary, untied."""
    return ModelConfig(
        n_layers=len(pattern), d_model=d_model, n_heads=n_heads, n_kv_heads=8, d_head=128, d_mlp=d_mlp, d_vocab=131072,
        n_ctx=n_ctx, norm="rmsnorm", norm_eps=1e-5, mlp="gelu", activation="relu2", mlp_bias=False,
        tie_word_embeddings=False, family="nemotron_h", positional="none", fused_qkv=False, qkv_bias=False,
        out_bias=False, one_sublayer=True, layer_types=pattern_types(pattern), mamba_n_heads=n_mamba_heads,
        mamba_d_head=64, mamba_d_state=d_state, mamba_n_groups=8, mamba_conv_width=4, mamba_conv_bias=True,
        mamba_chunk_size=128, bos_token_id=1, eos_token_id=2, name=name,
    )


# 52 layers (24 Mamba-2, 4 attention, 24 MLP) and 118 (54, 10, 54), as the Nemotron-H paper counts them; the 47B,
# pruned from the 56B, keeps 98 (46, 5, 47) with MLPs of 30,720: its counts as recalled, its order approximate
PATTERN_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
PATTERN_56B = "M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-"
PATTERN_47B = ("M-" * 8 + "M*-") * 5 + "M--"

PRESETS = named_presets(_preset("nemotron-h-8b", PATTERN_8B, 4096, 32, 21504, 128, 128, 8192),
                        _preset("nemotron-h-47b", PATTERN_47B, 8192, 64, 30720, 256, 256, 8192),
                        _preset("nemotron-h-56b", PATTERN_56B, 8192, 64, 32768, 256, 256, 8192))

# Attention then Mamba-2, or with 3 blocks Mamba-2, attention and MLP (the tests look at the heads of block 0 of the first,
# block 1 of the second); four Mamba-2 heads of 8 in two
# groups of B and C 6 wide, chunks of 16 (prompts span several), two kv heads, biases everywhere they can be, a step
# limit that binds.
TINY = dict(TINY_SHAPE, num_key_value_heads=2, head_dim=8, layers_block_type=["full_attention", "linear_attention"],
            mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2, conv_kernel=4, chunk_size=16,
            use_bias=True, mlp_bias=True, time_step_limit=[0.0, 2.0], initializer_range=0.1, tie_word_embeddings=False)

FAMILY = Family("nemotron_h", "NemotronHForCausalLM", "NemotronHConfig", "Nemotron-H 8B / 47B / 56B", read, write,
                LAYOUT, PRESETS, TINY,
                tiny_3_blocks=dict(num_hidden_layers=3, layers_block_type=["linear_attention", "full_attention", "mlp"]))

"""IBM Granite 4.0 (`granitemoehybrid`: H-Small, H-Tiny, H-Micro, and the attention-only Micro): pre-RMSNorm blocks
whose token mixer is a Mamba-2 mixer (lenskit.pieces.mamba2) or grouped-query attention without positions
(`positional="none"`; rotary ones under `position_embedding_type="rope"`), then routed experts (the top k router
logits, then a softmax) beside a shared SwiGLU MLP that every token runs (lenskit.pieces.shared_experts), or that
shared MLP alone where `num_local_experts` is 0. Granite's muP scalars are `cfg.scales`: the embedding times `embedding_multiplier`, each
sublayer's write times `residual_multiplier` (inside its output projection, so W_O, W_out and per-head results are
the writes as they reach the stream), the logits divided by `logits_scaling`; `attention_multiplier` is the scores'
scale itself (`query_pre_attn_scalar = attention_multiplier ** -2`). Its files hold the experts fused
(`block_sparse_moe.input_linear`, gate rows first, and `output_linear`); transformers 5 renames them in memory."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from ..config import ModelConfig
from . import writers
from .family import Family
from .fields import REFUSED, ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, FusedExperts, Layout
from .presets import named_presets
from .readers import common_fields, read_heads, read_kv_heads
from .rope import rope

# config.json's mixer kinds, both spellings: the published files' ("mamba", "attention") and transformers 5's
_LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full", "full_attention": "full"}
_HF_LAYER_TYPES = {"mamba": "linear_attention", "full": "full_attention"}  # the way back, as transformers 5 writes


def _layer_types(r: ConfigReader, n_layers: int) -> tuple[str, ...]:
    """`layer_types` (or its alias `layers_block_type`), one per block; absent: every block a Mamba-2 mixer, as
    transformers' config class fills it."""
    given = {k: r.d[k] for k in ("layer_types", "layers_block_type") if r.d.get(k) is not None}
    if len(given) == 2 and given["layer_types"] != given["layers_block_type"]:
        raise ValueError(f"config fields layer_types and layers_block_type disagree (model_type={r.family!r}): both spell "
                         "each block's mixer; keep one of them")
    types = next(iter(given.values()), ["mamba"] * n_layers)
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"config field layer_types={types!r} must list one of {sorted(_LAYER_TYPES)} for each of the "
                         f"{n_layers} layers (model_type={r.family!r})")
    return tuple(_LAYER_TYPES[t] for t in types)


def _step_limit(r: ConfigReader) -> tuple[float, float]:
    """time_step_limit: the range each Mamba-2 step size is clamped to; transformers 5 writes infinity tagged,
    {"__float__": "Infinity"}."""
    value = r.d.get("time_step_limit", [0.0, float("inf")])
    value = [0.0, float("inf")] if value is None else value
    tags = {"Infinity": float("inf"), "-Infinity": float("-inf")}
    if isinstance(value, list) and len(value) == 2:
        value = [tags.get(v.get("__float__"), v) if isinstance(v, dict) else v for v in value]
    if (not isinstance(value, list) or len(value) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                              for v in value) or not 0 <= value[0] <= value[1]):
        raise ValueError(f"config field time_step_limit={r.d['time_step_limit']!r} must be [low, high] with "
                         f"0 <= low <= high (model_type={r.family!r})")
    return float(value[0]), float(value[1])


def _mamba(r: ConfigReader, d_model: int) -> dict[str, Any]:
    """The Mamba-2 mixers' fields (`cfg.mamba`): heads of mamba_d_head ("auto": mamba_expand * hidden_size / heads)
    whose widths must make up mamba_expand * hidden_size, as transformers' config class checks."""
    n_heads = r.int("mamba_n_heads", 128)
    inner = r.int("mamba_expand", 2) * d_model
    d_head = r.d.get("mamba_d_head", "auto")
    d_head = inner // n_heads if d_head == "auto" else r.int("mamba_d_head")
    if n_heads * d_head != inner:
        raise ValueError(f"config fields mamba_n_heads={n_heads} and mamba_d_head={r.d.get('mamba_d_head', 'auto')!r}: "
                         f"the heads must make up mamba_expand * hidden_size = {inner} features (model_type={r.family!r}); "
                         "fix config.json")
    dt_min, dt_max = _step_limit(r)
    return {"mamba_n_heads": n_heads, "mamba_d_head": d_head, "mamba_d_state": r.int("mamba_d_state", 256),
            "mamba_n_groups": r.int("mamba_n_groups", 1), "mamba_conv_width": r.int("mamba_d_conv", 4),
            "mamba_conv_bias": r.bool("mamba_conv_bias", True), "mamba_in_bias": r.bool("mamba_proj_bias", False),
            "mamba_out_bias": r.bool("mamba_proj_bias", False), "mamba_chunk_size": r.int("mamba_chunk_size", 256),
            "mamba_dt_min": dt_min, "mamba_dt_max": dt_max, "mamba_norm": "gate_then_norm"}


def _mlp(r: ConfigReader) -> dict[str, Any]:
    """Routed experts beside the shared MLP, one shared expert shared_intermediate_size wide (num_local_experts > 0),
    or the shared MLP alone."""
    n_experts = r.int("num_local_experts", 8, positive=False)
    d_shared = r.int("shared_intermediate_size", 1024)
    d_expert = r.int("intermediate_size")
    r.float("router_aux_loss_coef", 0.001)  # typed only: a training loss, not part of the forward
    r.bool("output_router_logits", False)
    if n_experts == 0:
        return {"d_mlp": d_shared}
    k = r.int("num_experts_per_tok", 2, null=REFUSED)
    if k > n_experts:
        raise ValueError(f"config field num_experts_per_tok={k} exceeds num_local_experts={n_experts}: each token is "
                         f"routed to k of the experts (model_type={r.family!r}); fix config.json")
    return {"d_mlp": d_expert, "n_experts": n_experts, "n_experts_per_token": k, "d_expert": d_expert,
            "routing": "topk_softmax", "n_shared_experts": 1, "d_shared_expert": d_shared}


def read(r: ConfigReader) -> dict[str, Any]:
    r.require("hidden_act", ("silu",), "silu")
    r.require("normalization_function", ("rmsnorm",), "rmsnorm")  # the remote code's switch; transformers' is RMSNorm
    r.require("position_embedding_type", ("nope", "rope", None), None)
    n_layers = r.n_layers("num_hidden_layers")
    d_model, n_heads = read_heads(r, "hidden_size", "num_attention_heads", must_divide=True)
    d_head = d_model // n_heads  # transformers' attention takes hidden_size // num_attention_heads
    r.require("head_dim", (d_head, None), None)
    types = _layer_types(r, n_layers)
    positions = rope(r, d_head, types=("default",))
    if positions["rotary_dim"] != d_head:
        raise ValueError(f"config field partial_rotary_factor: transformers rotates all {d_head} features of each "
                         f"granitemoehybrid head; remove it (model_type={r.family!r})")
    if r.d.get("position_embedding_type") != "rope":  # transformers builds rotary positions for "rope" alone
        positions = {"positional": "none"}  # the rotary fields typed above, and unread, as transformers leaves them
    bias = r.bool("attention_bias", False)
    return {
        **common_fields(r, bos=1, eos=2), **positions,
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "d_head": d_head,
        "n_kv_heads": read_kv_heads(r, n_heads, None), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "norm_eps": r.float("rms_norm_eps", 1e-6, positive=True),
        "norm": "rmsnorm", "mlp": "swiglu_fused", "mlp_bias": False, "tie_word_embeddings": r.bool("tie_word_embeddings", False),
        "fused_qkv": False, "qkv_bias": bias, "out_bias": bias,
        "layer_types": types if "mamba" in types else None,
        "query_pre_attn_scalar": r.float("attention_multiplier", 1.0, positive=True) ** -2,
        "embedding_multiplier": r.float("embedding_multiplier", 1.0, positive=True),
        "residual_multiplier": r.float("residual_multiplier", 1.0, positive=True),
        "logits_multiplier": 1 / r.float("logits_scaling", 1.0, positive=True),
        **_mlp(r), **(_mamba(r, d_model) if "mamba" in types else {}),
    }


def write(cfg: ModelConfig) -> dict[str, Any]:
    moe, types = cfg.moe, cfg.layer_types or ("full",) * cfg.n_layers
    scalar = cfg.attention.query_pre_attn_scalar
    experts = {"num_local_experts": 0, "intermediate_size": cfg.d_mlp, "shared_intermediate_size": cfg.d_mlp} \
        if moe.n_experts is None else {
        "num_local_experts": moe.n_experts, "num_experts_per_tok": moe.n_experts_per_token,
        "intermediate_size": moe.d_expert, "shared_intermediate_size": moe.d_shared}
    out = {
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "hidden_act": "silu", "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.norm_eps, **writers.common_fields(cfg), "rope_parameters": writers.rope_parameters(cfg),
        "position_embedding_type": "rope" if cfg.positional == "rotary" else "nope", "attention_bias": cfg.attention.qkv_bias,
        "attention_dropout": 0.0, "attention_multiplier": (cfg.d_head if scalar is None else scalar) ** -0.5,
        "embedding_multiplier": cfg.scales.embedding, "residual_multiplier": cfg.scales.residual,
        "logits_scaling": 1 / cfg.scales.logits, "layer_types": [_HF_LAYER_TYPES[t] for t in types],
        **experts, "output_router_logits": False,
    }
    if "mamba" not in types:  # transformers checks the Mamba-2 widths without Mamba-2 blocks too: one head, whole
        return {**out, "mamba_n_heads": 1, "mamba_d_head": "auto"}
    mamba = cfg.mamba
    out.update(mamba_n_heads=mamba.n_heads, mamba_d_head=mamba.d_head, mamba_d_state=mamba.d_state,
               mamba_n_groups=mamba.n_groups, mamba_d_conv=mamba.conv_width, mamba_conv_bias=mamba.conv_bias,
               mamba_proj_bias=mamba.in_bias, mamba_expand=mamba.n_heads * mamba.d_head // cfg.d_model,
               mamba_chunk_size=mamba.chunk_size, time_step_limit=[mamba.dt_min, mamba.dt_max])
    return out


class GraniteExperts(FusedExperts):
    """Granite's experts, the only spelling its files have: `input_linear` [expert, 2 * d_expert, d_model] (each
    expert's gate rows, then its up rows) and `output_linear` [expert, d_model, d_expert], and the router's
    `router.layer`."""

    def fuse(self, expert: Callable[[int, str, str], torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        experts = range(cfg.moe.n_experts)
        return {self.gate_up: torch.stack([torch.cat([expert(e, "gate", "weight"), expert(e, "fc_in", "weight")])
                                           for e in experts]),  # [expert, 2 * d_expert, d_model]
                self.down: torch.stack([expert(e, "fc_out", "weight") for e in experts])}  # [expert, d_model, d_expert]


_MOE = "block_sparse_moe."
_EXPERTS = GraniteExperts(gate_up=_MOE + "input_linear.weight", down=_MOE + "output_linear.weight",
                          router=_MOE + "router.layer.weight", only=True)


class InMemoryNames(dict):
    """transformers 5's in-memory names of a block's experts and router (`from_hf` reads `state_dict()`) -> the
    files' (`Layout.aliases`, looked up by `get`), for any block."""

    _NAME = re.compile(r"(layers\.\d+\.block_sparse_moe\.)(experts\.gate_up_proj|experts\.down_proj|router\.weight)")
    _FILE = {"experts.gate_up_proj": "input_linear.weight", "experts.down_proj": "output_linear.weight",
             "router.weight": "router.layer.weight"}

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        m = self._NAME.fullmatch(name)
        return default if m is None else m.group(1) + self._FILE[m.group(2)]


# Attention under Llama's names; the shared MLP (or the dense one) fused as `shared_mlp.input_linear`; the per-expert
# names exist only between `Layout.split_fused` and `join_fused`; the Mamba-2 mixer under `mamba`.
_BLOCK = {
    **{k: v for k, v in LLAMA_BLOCK.items() if k.startswith(("ln", "attn.qkv", "attn.out"))},
    "mlp.gate_up.weight": "shared_mlp.input_linear.weight", "mlp.fc_out.weight": "shared_mlp.output_linear.weight",
    "mlp.shared.gate_up.weight": "shared_mlp.input_linear.weight",
    "mlp.shared.fc_out.weight": "shared_mlp.output_linear.weight", "mlp.router.weight": _MOE + "router.layer.weight",
    **{f"mlp.experts.{{e}}.{ours}.weight": f"{_MOE}experts.{{e}}.{ours}.weight" for ours in ("gate", "fc_in", "fc_out")},
    **{f"attn.{ours}": f"mamba.{theirs}" for ours, theirs in (
        ("in_proj.weight", "in_proj.weight"), ("in_proj.bias", "in_proj.bias"), ("conv_weight", "conv1d.weight"),
        ("conv_bias", "conv1d.bias"), ("dt_bias", "dt_bias"), ("A_log", "A_log"), ("D", "D"),
        ("norm.weight", "norm.weight"), ("out_proj.weight", "out_proj.weight"), ("out_proj.bias", "out_proj.bias"))},
}
LAYOUT = Layout(prefix="model.", blocks="layers", top=LLAMA.top, block=_BLOCK, fused=_EXPERTS, aliases=InMemoryNames())


def _preset(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, attention: tuple[int, ...] | None,
            n_experts: int | None, k: int | None, d_expert: int, d_shared: int, mamba_heads: int | None,
            nope: bool, base: float, scales: tuple[float, float, float, float]) -> ModelConfig:
    """Granite 4.0 (shapes from the published config.json files as recalled, cross-checked against the model cards'
    parameter counts): a 100,352-token vocabulary, 131,072 positions, RMSNorm eps 1e-5, a tied embedding;
    `attention` lists the attention blocks among Mamba-2 ones (None: attention only), each Mamba-2 mixer 2 * d_model
    wide in heads of 64 with a 128-wide state and one group; `scales` are the embedding, residual and attention
    multipliers and the logits' divisor."""
    embedding, residual, attention_multiplier, logits_scaling = scales
    types = None if attention is None else tuple("full" if i in attention else "mamba" for i in range(n_layers))
    experts = {} if n_experts is None else dict(
        n_experts=n_experts, n_experts_per_token=k, d_expert=d_expert, routing="topk_softmax",
        n_shared_experts=1, d_shared_expert=d_shared)
    mamba = {} if mamba_heads is None else dict(
        mamba_n_heads=mamba_heads, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_conv_width=4,
        mamba_conv_bias=True, mamba_in_bias=False, mamba_out_bias=False, mamba_chunk_size=256, mamba_norm="gate_then_norm")
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_model // n_heads,
        d_mlp=d_shared if n_experts is None else d_expert, d_vocab=100352, n_ctx=131072, norm="rmsnorm", norm_eps=1e-5,
        mlp="swiglu_fused", mlp_bias=False, tie_word_embeddings=True, family="granitemoehybrid",
        positional="none" if nope else "rotary", **({} if nope else {"rotary_base": base}), fused_qkv=False,
        qkv_bias=False, out_bias=False, layer_types=types,
        query_pre_attn_scalar=attention_multiplier ** -2, embedding_multiplier=embedding, residual_multiplier=residual,
        logits_multiplier=1 / logits_scaling, bos_token_id=100257, eos_token_id=100257, name=name, **experts, **mamba)


_H_ATTENTION = (5, 15, 25, 35)  # the H models: one attention block in ten, the rest Mamba-2
PRESETS = named_presets(
    _preset("granite-4.0-h-small", 40, 4096, 32, 8, _H_ATTENTION, 72, 10, 768, 768, 128, True, 10000.0,
            (12.0, 0.246, 0.0078125, 16.0)),
    _preset("granite-4.0-h-tiny", 40, 1536, 12, 4, _H_ATTENTION, 64, 6, 512, 1024, 48, True, 10000.0,
            (12.0, 0.22, 0.0078125, 6.0)),
    _preset("granite-4.0-h-micro", 40, 2048, 16, 4, _H_ATTENTION, None, None, 8192, 8192, 64, True, 10000.0,
            (12.0, 0.246, 0.0078125, 8.0)),
    _preset("granite-4.0-micro", 40, 2560, 40, 8, None, None, None, 8192, 8192, None, False, 10_000_000.0,
            (12.0, 0.22, 0.015625, 10.0)),
)

# An attention block (grouped-query, no positions) then a Mamba-2 one (4 heads of 16, a state 8 wide, chunks of 8 so
# that prompts span several), and with 3 blocks Mamba-2, attention, Mamba-2 (the tests look at block 0's heads in the
# first, block 1's in the second); routed experts (4, top 2, 16 wide) beside a shared MLP 24 wide; the muP scalars
# away from 1 and from powers of two.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=16,
            shared_intermediate_size=24, vocab_size=101, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            num_local_experts=4, num_experts_per_tok=2, layer_types=["attention", "mamba"],
            position_embedding_type="nope", embedding_multiplier=2.5, residual_multiplier=0.7, attention_multiplier=0.3,
            logits_scaling=1.25, initializer_range=0.1, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
            mamba_chunk_size=8)

FAMILY = Family("granitemoehybrid", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                "Granite 4.0 (H-Small, H-Tiny, H-Micro, Micro)", read, write, LAYOUT, PRESETS, TINY,
                tiny_3_blocks=dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"]))

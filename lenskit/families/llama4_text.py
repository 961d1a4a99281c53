"""Llama 4's text model (`llama4_text`: Scout 17B-16E, Maverick 17B-128E): Llama's block with every fourth block
without rotary (`no_rope_layers`), chunked local attention in the rotary blocks (`attention_chunk_size`), rotary on
adjacent pairs of dims, a gainless q/k norm in the rotary blocks (`use_qk_norm`), a temperature on the queries of the
blocks without rotary (`attn_temperature_tuning`), and MoE blocks (every block in Scout, every other one in Maverick)
whose routed experts read the stream scaled by the sigmoid of their router logit, beside one shared expert
(lenskit.pieces.shared_experts.ScoredInputMoE). The dense blocks are `intermediate_size_mlp` wide, the experts
`intermediate_size`. Its files hold the experts fused (`Llama4Experts`). The multimodal `llama4` checkpoints are
another model_type; their `text_config` is this one's config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..config import ROPE_TYPES, ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, FusedExperts, Layout
from .presets import llama_preset, named_presets
from .readers import llama_like, nope_layers

_LAYER_TYPES = {"chunked_attention": "chunked", "full_attention": "full"}


def _layer_types(r: ConfigReader, n_layers: int, nope: tuple[int, ...], chunk: int | None) -> tuple[str, ...]:
    """`layer_types`, or as transformers fills it: the rotary blocks chunked where there is a chunk size."""
    types = r.d.get("layer_types")
    if types is None:
        return tuple("chunked" if chunk is not None and i not in nope else "full" for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"config field layer_types={types!r} must list one of {sorted(_LAYER_TYPES)} for each of the "
                         f"{n_layers} layers (model_type={r.family!r})")
    if chunk is None and "chunked_attention" in types:  # transformers' chunked mask refuses it too
        raise ValueError("config field attention_chunk_size=None, but layer_types has chunked_attention layers; give "
                         f"the chunk size (model_type={r.family!r})")
    return tuple(_LAYER_TYPES[t] for t in types)


def _moe_layers(r: ConfigReader, n_layers: int) -> tuple[int, ...]:
    """The MoE blocks: `moe_layers`, or every `interleave_moe_layer_step`-th block (the last of each step)."""
    step = r.int("interleave_moe_layer_step", 1)
    given = r.d.get("moe_layers")
    if given is None:
        return tuple(range(step - 1, n_layers, step))
    if not isinstance(given, list) or any(type(i) is not int or not 0 <= i < n_layers for i in given) \
            or given != sorted(set(given)):
        raise ValueError(f"config field moe_layers={given!r} must list increasing block indices in [0, {n_layers}) "
                         f"(model_type={r.family!r})")
    return tuple(given)


def read(r: ConfigReader) -> dict[str, Any]:
    bias = r.bool("attention_bias", False)
    fields = llama_like(r, bias, bias, False, eps=1e-5, bos=1, eos=2, kv_heads=8, head_dim=128, null_head_dim=False,
                        null_kv_heads=False, rope_types=ROPE_TYPES, default_theta=500000.0)
    n = fields["n_layers"]
    nope = nope_layers(r, n)
    chunk = r.int("attention_chunk_size", 8192, null=None)
    types = _layer_types(r, n, nope, chunk)
    chunked = "chunked" in types
    moe_layers = _moe_layers(r, n)
    n_experts, k = r.int("num_local_experts", 16), r.int("num_experts_per_tok", 1)
    if k > n_experts:
        raise ValueError(f"config field num_experts_per_tok={k} exceeds num_local_experts={n_experts}: each token is "
                         f"routed to k of the experts (model_type={r.family!r}); fix config.json")
    r.float("router_aux_loss_coef", 0.001)  # typed only: training losses and noise, not part of the forward
    r.float("router_jitter_noise", 0.0)
    tuned = r.bool("attn_temperature_tuning", True)
    floor = r.int("floor_scale", 8192)
    return {
        **fields, "d_mlp": r.int("intermediate_size_mlp", 16384), "rope_adjacent_pairs": True, "nope_layers": nope,
        "layer_types": types if chunked else None, "attn_chunk_size": chunk if chunked else None,
        "qk_unit_norm": r.bool("use_qk_norm", True), "attn_temperature_floor": floor if tuned else None,
        "attn_temperature_scale": r.float("attn_scale", 0.1),
        "n_experts": n_experts, "n_experts_per_token": k, "d_expert": r.int("intermediate_size", 8192),
        "routing": "sigmoid_topk", "n_shared_experts": 1, "dense_layers": tuple(i for i in range(n) if i not in moe_layers),
    }


def write(cfg: ModelConfig) -> dict[str, Any]:
    attention, moe = cfg.attention, cfg.moe
    types = [cfg.layer_type(i) for i in range(cfg.n_layers)]
    return {
        **writers.llama_like(cfg), "intermediate_size": moe.d_expert, "intermediate_size_mlp": cfg.d_mlp,
        "attention_bias": attention.qkv_bias, "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_layers)],
        "attention_chunk_size": attention.chunk_size,
        "layer_types": [{"chunked": "chunked_attention", "full": "full_attention"}[t] for t in types],
        "use_qk_norm": attention.qk_unit_norm, "attn_temperature_tuning": attention.temperature_floor is not None,
        "floor_scale": attention.temperature_floor or 8192, "attn_scale": attention.temperature_scale,
        "num_local_experts": moe.n_experts, "num_experts_per_tok": moe.n_experts_per_token,
        "moe_layers": [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)], "output_router_logits": False,
    }


@dataclass(frozen=True)
class Llama4Experts(FusedExperts):
    """Llama 4's experts, the only spelling its files have: `gate_up_proj` [expert, d_model, 2 * d_expert]
    (transposed, `x @ W`: each expert's gate columns, then its up columns) and `down_proj` [expert, d_expert, d_model],
    beside the router `feed_forward.router`."""

    gate_up: str = "feed_forward.experts.gate_up_proj"
    down: str = "feed_forward.experts.down_proj"
    router: str = "feed_forward.router.weight"
    only: bool = True

    def shapes(self, cfg) -> tuple[tuple[int, ...], ...]:
        n, d, m = cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert
        return (n, d, 2 * m), (n, m, d)

    def parts(self, gate_up: torch.Tensor, down: torch.Tensor, cfg) -> Iterator[tuple[int, str, torch.Tensor]]:
        m = cfg.moe.d_expert
        for e in range(cfg.moe.n_experts):
            yield e, "gate", gate_up[e, :, :m].T
            yield e, "fc_in", gate_up[e, :, m:].T
            yield e, "fc_out", down[e].T

    def fuse(self, expert: Callable[[int, str, str], torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        experts = range(cfg.moe.n_experts)
        return {
            self.gate_up: torch.stack([torch.cat([expert(e, "gate", "weight").T, expert(e, "fc_in", "weight").T], dim=-1)
                                       for e in experts]),  # [expert, d_model, 2 * d_expert]
            self.down: torch.stack([expert(e, "fc_out", "weight").T for e in experts]),  # [expert, d_expert, d_model]
        }


_PROJECTIONS = (("gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj"))
# Llama's attention and norms; the MLP is `feed_forward` (dense, or router, shared expert and experts, whose per-expert
# names exist only between `Layout.split_fused` and `Layout.join_fused`)
_BLOCK = {
    **{ours: theirs for ours, theirs in LLAMA_BLOCK.items() if not ours.startswith("mlp.")},
    **{f"mlp.{ours}.weight": f"feed_forward.{theirs}.weight" for ours, theirs in _PROJECTIONS},
    "mlp.router.weight": "feed_forward.router.weight",
    **{f"mlp.shared.{ours}.weight": f"feed_forward.shared_expert.{theirs}.weight" for ours, theirs in _PROJECTIONS},
    **{f"mlp.experts.{{e}}.{ours}.weight": f"feed_forward.experts.{{e}}.{ours}.weight" for ours, _ in _PROJECTIONS},
}

LAYOUT = Layout(prefix="model.", blocks="layers", top=LLAMA.top, block=_BLOCK, buffers=LLAMA.buffers,
                fused=Llama4Experts())


def _preset(name: str, n_ctx: int, n_experts: int, moe_step: int, qk_norm: bool, **rope: Any) -> ModelConfig:
    """Llama 4's 17B-active shape: 48 blocks of d_model 5120, 40 heads of 128 (8 kv heads), every fourth block
    without rotary and the others chunked to 8192 tokens, the temperature tuned from 8192 tokens at 0.1, one routed
    expert (8192 wide) and the shared one per MoE block, dense blocks 16384 wide; a 202048-token vocabulary."""
    nope = tuple(range(3, 48, 4))
    return llama_preset(
        name, "llama4_text", 48, 5120, 40, 8, 16384, 202048, n_ctx, False, 500000.0, d_head=128, norm_eps=1e-5,
        rope_adjacent_pairs=True, nope_layers=nope, layer_types=tuple("full" if i in nope else "chunked" for i in range(48)),
        attn_chunk_size=8192, qk_unit_norm=qk_norm, attn_temperature_floor=8192, attn_temperature_scale=0.1,
        n_experts=n_experts, n_experts_per_token=1, d_expert=8192, routing="sigmoid_topk", n_shared_experts=1,
        dense_layers=tuple(i for i in range(48) if (i + 1) % moe_step), bos_token_id=200000, eos_token_id=200001, **rope)


# meta-llama/Llama-4-Scout-17B-16E and Llama-4-Maverick-17B-128E's text_config (from memory, not downloaded): Scout
# every block MoE, with the q/k norm and Llama 3's rotary scaling (x16 over 8192 tokens); Maverick every other block,
# neither
PRESETS = named_presets(
    _preset("llama-4-scout", 10485760, 16, 1, True, rope_type="llama3", rope_factor=16.0, rope_low_freq_factor=1.0,
            rope_high_freq_factor=1.0, rope_original_n_ctx=8192),
    _preset("llama-4-maverick", 1048576, 128, 2, False))

# 2 (or 3) blocks: block 0 rotary, chunked to 5 positions (shorter than the tests' prompts) with the q/k norm, dense,
# 48 wide; block 1 without rotary, its queries' temperature rising from position 2 (floor 3, strength 0.5), a MoE of 4
# experts 16 wide, 2 per token, beside the shared one; Llama 3's rotary scaling on adjacent pairs; weights 5x the usual
# scale so the router's sigmoids spread.
TINY = dict(TINY_SHAPE, num_key_value_heads=2, head_dim=8, intermediate_size=16, intermediate_size_mlp=48,
            num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=2,
            attention_chunk_size=5, floor_scale=3, attn_scale=0.5, initializer_range=0.1,
            rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=16))

FAMILY = Family("llama4_text", "Llama4ForCausalLM", "Llama4TextConfig", "Llama 4 Scout, Maverick (text)", read, write,
                LAYOUT, PRESETS, TINY)

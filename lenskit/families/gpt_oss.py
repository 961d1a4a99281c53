"""gpt-oss (`gpt_oss`): attention sinks, every other block sliding (from the first), YaRN, biases on q/k/v/o and the
router, the top k router logits then a softmax, and biased experts with the clamped SwiGLU; its files hold the experts
fused, gate and up interleaved (`GptOssExperts`; its MXFP4 files quantized, lenskit.io.mxfp4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..config import ModelConfig
from . import writers
from .family import TINY_MOE_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, FusedExperts, Layout
from .presets import named_presets
from .readers import llama_like, routed_experts, sliding_windows

# gpt-oss: transformers 5's GptOssConfig fills absent rotary fields with YaRN over a 4096-token pre-training length.
_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}


def read(r: ConfigReader) -> dict[str, Any]:
    """gpt-oss: attention sinks, every other block sliding (from the first), YaRN, biases on q/k/v/o and the router,
    the top k logits then a softmax, and biased experts with the clamped SwiGLU."""
    bias = r.bool("attention_bias", True)
    fields = llama_like(r, bias, bias, False, eps=1e-5, bos=None, eos=None, kv_heads=8, head_dim=64,
                        null_head_dim=False, null_kv_heads=False, rope_types=("default", "yarn"), default_theta=150000.0,
                        default_params=_ROPE)
    experts = routed_experts(r, "num_local_experts", "num_experts", 128, 4, renorm=False)
    return {**fields, **experts, **sliding_windows(r, fields["n_layers"], 2, 128), "attn_sinks": True, "routing": "topk_softmax",
            "mlp": "swiglu_clamped", "router_bias": True, "swiglu_alpha": r.float("swiglu_alpha", 1.702, positive=True),
            "swiglu_limit": r.float("swiglu_limit", 7.0, positive=True)}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "sliding_window": cfg.sliding_window,
            "layer_types": writers.hf_layer_types(cfg), "swiglu_alpha": cfg.moe.swiglu_alpha,
            "swiglu_limit": cfg.moe.swiglu_limit, **writers.routed_experts(cfg, "num_local_experts")}


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2 * d_expert], gate and up interleaved (gpt-oss's layout) -> gate, up, each [..., d_expert] (views)."""
    return gate_up[..., 0::2], gate_up[..., 1::2]


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The inverse of `split_gate_up`: [..., d_expert] each -> [..., 2 * d_expert]."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


@dataclass(frozen=True)
class GptOssExperts(FusedExperts):
    """gpt-oss's experts, the only spelling its files have: `gate_up_proj` [expert, d_model, 2 * d_expert]
    (transposed: `x @ W`; gate and up interleaved along the last axis, gate at the even columns), `down_proj`
    [expert, d_expert, d_model], their biases [expert, 2 * d_expert] (interleaved too) and [expert, d_model], and the
    router `mlp.router` with its bias. (Its MXFP4 files hold the two weights quantized: lenskit.io.mxfp4.)"""

    router: str = "mlp.router.weight"
    biases: tuple[str, str] | None = ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")
    only: bool = True

    def shapes(self, cfg) -> tuple[tuple[int, ...], ...]:
        n, d, m = cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert
        return (n, d, 2 * m), (n, m, d), (n, 2 * m), (n, d)

    def parts(self, gate_up: torch.Tensor, down: torch.Tensor, cfg) -> Iterator[tuple[int, str, torch.Tensor]]:
        for e in range(cfg.moe.n_experts):
            gate, up = split_gate_up(gate_up[e])  # [d_model, d_expert] each
            yield e, "gate", gate.T
            yield e, "fc_in", up.T
            yield e, "fc_out", down[e].T

    def bias_parts(self, gate_up: torch.Tensor, down: torch.Tensor, cfg) -> Iterator[tuple[int, str, torch.Tensor]]:
        for e in range(cfg.moe.n_experts):
            gate, up = split_gate_up(gate_up[e])  # [d_expert] each
            yield e, "gate", gate
            yield e, "fc_in", up
            yield e, "fc_out", down[e]

    def fuse(self, expert: Callable[[int, str, str], torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        experts = range(cfg.moe.n_experts)
        gate_up_bias, down_bias = self.biases
        return {
            self.gate_up: torch.stack([_interleave(expert(e, "gate", "weight").T, expert(e, "fc_in", "weight").T)
                                       for e in experts]),  # [expert, d_model, 2 * d_expert]
            self.down: torch.stack([expert(e, "fc_out", "weight").T for e in experts]),  # [expert, d_expert, d_model]
            gate_up_bias: torch.stack([_interleave(expert(e, "gate", "bias"), expert(e, "fc_in", "bias")) for e in experts]),
            down_bias: torch.stack([expert(e, "fc_out", "bias") for e in experts]),
        }


# gpt-oss: the router with its bias, attention sinks, and per-expert names that exist only between
# `Layout.split_fused` and `Layout.join_fused` (its files spell the experts fused, `GptOssExperts`).
_BLOCK = {
    **LLAMA_BLOCK, "attn.sinks": "self_attn.sinks", "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
    **{f"mlp.experts.{{e}}.{ours}.{p}": f"mlp.experts.{{e}}.{ours}.{p}" for ours in ("gate", "fc_in", "fc_out")
       for p in ("weight", "bias")},
}

LAYOUT = Layout(prefix="model.", blocks="layers", top=LLAMA.top, block=_BLOCK, fused=GptOssExperts())

def _preset(name: str, n_layers: int, n_experts: int) -> ModelConfig:
    """gpt-oss: 64 heads of 64 over d_model 2880, 8 kv heads, every other block sliding (window 128), YaRN
    (x32 over a 4096-token pre-training length), biased attention and router, attention sinks, top-4 experts."""
    return ModelConfig(
        n_layers=n_layers, d_model=2880, n_heads=64, n_kv_heads=8, d_head=64, d_mlp=2880, d_vocab=201088,
        n_ctx=131072, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu_clamped", tie_word_embeddings=False, family="gpt_oss",
        positional="rotary", rotary_base=150000.0, rope_type="yarn", rope_factor=32.0, rope_original_n_ctx=4096,
        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=False, fused_qkv=False, qkv_bias=True, out_bias=True,
        attn_sinks=True, sliding_window=128, layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers)),
        n_experts=n_experts, n_experts_per_token=4, routing="topk_softmax", router_bias=True, eos_token_id=200002,
        name=name,
    )


PRESETS = named_presets(_preset("gpt-oss-20b", 24, 32), _preset("gpt-oss-120b", 36, 128))

# the first block sliding with a window shorter than the prompt, the second full; YaRN (x4 over 16 tokens); heads of
# 16 (q is wider than d_model); weights large enough, and a limit low enough, that the clamp bites; a sigmoid gain that
# is not the default. conftest moves the sinks far from zero and the expert biases away from it.
TINY = dict(TINY_MOE_SHAPE, num_local_experts=4, head_dim=16, sliding_window=5, initializer_range=0.2,
            swiglu_limit=1.5, swiglu_alpha=1.5,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False, original_max_position_embeddings=16))

FAMILY = Family("gpt_oss", "GptOssForCausalLM", "GptOssConfig", "gpt-oss", read, write, LAYOUT, PRESETS, TINY)

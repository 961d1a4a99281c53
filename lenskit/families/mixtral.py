"""Mixtral (`mixtral`): Llama's attention with a sliding window, and in every block a router over SwiGLU experts,
the top-k weights renormalised; its checkpoints name the experts w1, w3, w2 under `block_sparse_moe`."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_MOE_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, FusedExperts, Layout
from .presets import llama_preset, named_presets
from .readers import llama_like, rotary_base_default, routed_experts


def read(r: ConfigReader) -> dict[str, Any]:
    r.float("router_jitter_noise", 0.0)  # typed only: noise on the router's input in training, off at inference
    fields = llama_like(r, False, False, False, eps=1e-5, bos=1, eos=2, kv_heads=8, null_kv_heads=False)
    return {**rotary_base_default(r, fields, 1_000_000.0), "sliding_window": r.int("sliding_window", None),
            **routed_experts(r, "num_local_experts", "num_experts", 8, 2, renorm=True)}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "sliding_window": cfg.sliding_window,
            **writers.routed_experts(cfg, "num_local_experts"), "router_jitter_noise": 0.0}


LAYOUT = Layout(
    prefix="model.", blocks="layers", top=LLAMA.top,
    block={**LLAMA_BLOCK, "mlp.router.weight": "block_sparse_moe.gate.weight",
           **{f"mlp.experts.{{e}}.{ours}.weight": f"block_sparse_moe.experts.{{e}}.{theirs}.weight"
              for ours, theirs in (("gate", "w1"), ("fc_in", "w3"), ("fc_out", "w2"))}},
    buffers=LLAMA.buffers, fused=FusedExperts(),
)

PRESETS = named_presets(llama_preset("mixtral-8x7b", "mixtral", 32, 4096, 32, 8, 14336, 32000, 32768, False, 1_000_000.0,
                                     norm_eps=1e-5, bos_token_id=1, eos_token_id=2, n_experts=8, n_experts_per_token=2,
                                     routing="softmax_topk_renorm"))

# a window shorter than the prompt; weights 5x the usual scale, so its random blocks move the predictions enough for a
# tuned lens to learn
TINY = dict(TINY_MOE_SHAPE, num_local_experts=4, sliding_window=5, head_dim=8, initializer_range=0.1)

FAMILY = Family("mixtral", "MixtralForCausalLM", "MixtralConfig", "Mixtral", read, write, LAYOUT, PRESETS, TINY)

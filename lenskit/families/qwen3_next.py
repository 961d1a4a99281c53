"""Qwen3-Next (`qwen3_next`, Qwen3-Next-80B-A3B): Qwen 3.5's hybrid of Gated DeltaNet blocks and gated full attention
(`qwen3_5_text`), the DeltaNet's projections fused in two (lenskit.pieces.deltanet, `linear.fused`), and in every block
but the dense ones routed experts beside one shared expert whose output a sigmoid gate scales
(lenskit.pieces.shared_experts). A published checkpoint's multi-token-prediction weights (`mtp.*`) are left unread, as
transformers leaves them."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..pieces.deltanet import fused_to_ours, ours_to_fused
from . import writers
from .family import TINY_MOE_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, FusedExperts, Layout, Reshape
from .presets import named_presets
from .qwen3_5_text import DELTANET_BLOCK, linear_attention_config, linear_attention_fields
from .readers import llama_like, qwen_dense_layers, routed_experts


def read(r: ConfigReader) -> dict[str, Any]:
    """Qwen3-Next: gated full attention (per-head q/k norms, partial rotary) every `full_attention_interval`-th block,
    Gated DeltaNet blocks between, (1 + w) RMSNorms; experts in every `decoder_sparse_step`-th block not in
    `mlp_only_layers` (none where num_experts is 0), each with one shared expert of width
    shared_expert_intermediate_size."""
    r.require("attention_bias", (False,), False)
    r.require("use_sliding_window", (False,), False)  # remote-code fields transformers' class does not read
    r.require("attn_output_gate", (True,), True)
    r.int("mtp_num_hidden_layers", 1, positive=False)  # typed only: the MTP block transformers does not build
    r.bool("mtp_use_dedicated_embeddings", False)
    fields = llama_like(r, False, False, False, eps=1e-6, bos=None, eos=None, kv_heads=2, head_dim=256,
                        null_head_dim=False, null_kv_heads=False, rope_types=("default",), default_fraction=0.25)
    n = fields["n_layers"]
    out = {**fields, "norm": "rmsnorm_offset", "qk_norm": True, "attn_output_gate": True, "linear_fused": True,
           **linear_attention_fields(r, n)}
    if "linear_n_k_heads" not in out:  # no linear block: the fused switch has nothing to describe
        del out["linear_fused"]
    shared_width = r.int("shared_expert_intermediate_size", 512)
    n_experts = r.int("num_experts", 512, positive=False)
    if n_experts == 0:  # transformers builds every block dense
        r.int("num_experts_per_tok", 10)
        return out
    dense = qwen_dense_layers(r, n)
    if len(dense) == n:  # no sparse block: the experts' fields describe nothing built
        return out
    # the shared expert's width is read here, so routed_experts' refusal of shared experts must not see it
    experts = routed_experts(ConfigReader({k: v for k, v in r.d.items() if k != "shared_expert_intermediate_size"},
                                          r.family, r.n_blocks), "num_experts", "num_local_experts", 512, 10,
                             renorm=r.bool("norm_topk_prob", True))
    return {**out, **experts, "d_expert": r.int("moe_intermediate_size", 512), "dense_layers": dense,
            "n_shared_experts": 1, "d_shared_expert": shared_width, "shared_expert_gate": True}


def write(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    experts = {"num_experts": 0} if moe.n_experts is None else {
        **writers.routed_experts(cfg, "num_experts"), "moe_intermediate_size": moe.d_expert,
        "norm_topk_prob": writers.norm_topk(cfg), "decoder_sparse_step": 1, "mlp_only_layers": list(moe.dense_layers),
        "shared_expert_intermediate_size": moe.d_shared}
    return {**writers.llama_like(cfg), "attention_bias": cfg.attention.qkv_bias,
            "rope_parameters": writers.rope_parameters(cfg, partial=True), **linear_attention_config(cfg), **experts}


def _fused(which: str) -> Reshape:
    """A fused DeltaNet projection (`in_proj_qkvz`, `in_proj_ba`), its rows per q/k head in the file, by kind in ours."""
    return Reshape(lambda t, cfg: fused_to_ours(t, cfg, which), lambda t, cfg: ours_to_fused(t, cfg, which))


_PROJECTIONS = (("gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj"))
_BLOCK = {
    **LLAMA_BLOCK, **DELTANET_BLOCK,
    "attn.in_qkvz.weight": "linear_attn.in_proj_qkvz.weight", "attn.in_ba.weight": "linear_attn.in_proj_ba.weight",
    "mlp.router.weight": "mlp.gate.weight", "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight",
    **{f"mlp.shared.{ours}.weight": f"mlp.shared_expert.{theirs}.weight" for ours, theirs in _PROJECTIONS},
    **{f"mlp.experts.{{e}}.{ours}.weight": f"mlp.experts.{{e}}.{theirs}.weight" for ours, theirs in _PROJECTIONS},
}
LAYOUT = Layout(prefix="model.", blocks="layers", top=LLAMA.top, block=_BLOCK, buffers=LLAMA.buffers,
                reshape={"attn.in_qkvz.weight": _fused("qkvz"), "attn.in_ba.weight": _fused("ba")},
                fused=FusedExperts(), unread=lambda name, cfg: name.startswith("mtp."))

# Qwen/Qwen3-Next-80B-A3B-{Base,Instruct,Thinking}'s config.json: 48 blocks of d_model 2048, three Gated DeltaNet blocks
# (16 q/k heads of 128, 32 value heads of 128) then one gated full-attention block (16 heads of 256, 2 kv heads, a
# quarter of each rotating, base 1e7); 512 experts 512 wide, 10 per token, and a shared expert 512 wide in every block.
PRESETS = named_presets(ModelConfig(
    n_layers=48, d_model=2048, n_heads=16, n_kv_heads=2, d_head=256, d_mlp=5120, d_vocab=151936, n_ctx=262144,
    norm="rmsnorm_offset", norm_eps=1e-6, mlp="swiglu", tie_word_embeddings=False, family="qwen3_next",
    positional="rotary", rotary_base=10_000_000.0, rotary_dim=64, fused_qkv=False, qkv_bias=False, out_bias=False,
    qk_norm=True, attn_output_gate=True, layer_types=tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(48)),
    linear_n_k_heads=16, linear_n_v_heads=32, linear_d_k=128, linear_d_v=128, linear_conv_width=4, linear_fused=True,
    n_experts=512, n_experts_per_token=10, d_expert=512, routing="softmax_topk_renorm", n_shared_experts=1,
    d_shared_expert=512, shared_expert_gate=True, bos_token_id=151643, eos_token_id=151645,
    name="qwen3-next-80b-a3b"))

# A gated full-attention block with experts, then a Gated DeltaNet block with the dense MLP (mlp_only_layers); with
# 3 blocks linear, full (dense), linear. Two q/k heads serving four value heads (so the fused projections' per-head
# grouping matters), d_k != d_v, half of each attention head rotating, a shared expert wider than the routed ones,
# weights large enough that the linear blocks' writes matter, room for prompts longer than the 64-position chunk.
TINY = dict(TINY_MOE_SHAPE, head_dim=16, max_position_embeddings=256, initializer_range=0.1, num_experts=4,
            moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[1],
            layer_types=["full_attention", "linear_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))

FAMILY = Family("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", "Qwen3-Next", read, write, LAYOUT, PRESETS,
                TINY, tiny_3_blocks=dict(num_hidden_layers=3, mlp_only_layers=[1],
                                         layer_types=["linear_attention", "full_attention", "linear_attention"]))

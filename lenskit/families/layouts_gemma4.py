"""Gemma 4's checkpoint layout (`GEMMA4`): Gemma's names, plus each block's layer scalar; E2B/E4B's per-layer inputs
(model level and per block) and kv-sharing blocks, whose only projection is q (qkv.QueryOnly), and whose k/v
projections and norms, which hub checkpoints still hold, no forward reads (`unread`); 26B-A4B's router, fused
experts (as transformers stores them, `experts.gate_up_proj` and `experts.down_proj`) and their norms."""

from __future__ import annotations

import re

from .layouts import GEMMA, Layout

_BLOCK = {
    **GEMMA.block, "layer_scalar": "layer_scalar",
    "attn.qkv.weight": "self_attn.q_proj.weight", "attn.qkv.bias": "self_attn.q_proj.bias",
    "per_layer.gate.weight": "per_layer_input_gate.weight", "per_layer.out.weight": "per_layer_projection.weight",
    "per_layer.ln_post.weight": "post_per_layer_input_norm.weight",
    "mlp.ln_dense_post.weight": "post_feedforward_layernorm_1.weight", "mlp.router.scale": "router.scale",
    "mlp.router.proj.weight": "router.proj.weight", "mlp.router.per_expert_scale": "router.per_expert_scale",
    "mlp.ln_experts.weight": "pre_feedforward_layernorm_2.weight", "mlp.experts.gate_up": "experts.gate_up_proj",
    "mlp.experts.down": "experts.down_proj", "mlp.ln_experts_post.weight": "post_feedforward_layernorm_2.weight",
}
_SHARED_KV = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def _unread(name: str, cfg) -> bool:
    """A kv-sharing block's k/v projection or norm: hub checkpoints store them, no forward reads them (transformers'
    `_keys_to_ignore_on_load_unexpected`)."""
    m = _SHARED_KV.match(name)
    return m is not None and int(m.group(1)) < cfg.n_layers and cfg.kv_source(int(m.group(1))) is not None


GEMMA4 = Layout(
    prefix="model.", blocks="layers",
    top={**GEMMA.top, "per_layer_inputs.embed.weight": "embed_tokens_per_layer.weight",
         "per_layer_inputs.proj.weight": "per_layer_model_projection.weight",
         "per_layer_inputs.proj_norm.weight": "per_layer_projection_norm.weight"},
    block=_BLOCK, unread=_unread,
)

"""What the families' published shapes (presets) share: the builders of the Llama-like and Gemma-like shapes, each a
`ModelConfig` from the numbers a published config.json gives. A family's own presets, and any builder only it uses,
are in its module (`lenskit.families.llama.PRESETS`).
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig


def named_presets(*configs: ModelConfig) -> dict[str, ModelConfig]:
    return {c.name: c for c in configs}


def llama_preset(name: str, family: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, d_vocab: int,
           n_ctx: int, tied: bool, base: float, d_head: int | None = None, **extra: Any) -> ModelConfig:
    """A Llama-like shape: RMSNorm (eps 1e-6), SwiGLU, rotary at `base`, no biases; `extra` overrides any field."""
    fields = dict(norm="rmsnorm", mlp="swiglu", norm_eps=1e-6, fused_qkv=False, qk_norm=False, qkv_bias=False)
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, d_mlp=d_mlp,
        d_vocab=d_vocab, n_ctx=n_ctx, tie_word_embeddings=tied, family=family, positional="rotary", rotary_base=base,
        out_bias=False, name=name, **{**fields, **extra},
    )


def gemma_preset(name: str, family: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, d_vocab: int,
           n_ctx: int, window: int, pattern: int, **extra: Any) -> ModelConfig:
    """Gemma 2 (every other block local, soft-caps) or Gemma 3 text (one global block in `pattern`, q/k norms)."""
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=256, d_mlp=d_mlp,
        d_vocab=d_vocab, n_ctx=n_ctx, norm="rmsnorm_offset", norm_eps=1e-6, mlp="geglu", activation="gelu_pytorch_tanh",
        norm_placement="sandwich", scale_embed=True, tie_word_embeddings=True, family=family, positional="rotary",
        fused_qkv=False, qkv_bias=False, out_bias=False, query_pre_attn_scalar=256.0, sliding_window=window,
        layer_types=tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)),
        bos_token_id=2, eos_token_id=1, name=name, **extra,
    )

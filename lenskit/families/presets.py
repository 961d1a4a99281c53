"""Published shapes (presets): one builder per kind of family, each a `ModelConfig` from the numbers its published
config.json files give. The registry (`lenskit.families.FAMILIES`) names each family's presets with them."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig


def named_presets(*configs: ModelConfig) -> dict[str, ModelConfig]:
    return {c.name: c for c in configs}


def gpt2_preset(name: str, n_layers: int, d_model: int, n_heads: int) -> ModelConfig:
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_vocab=50257, n_ctx=1024,
        bos_token_id=50256, eos_token_id=50256, name=name,
    )


def pythia_preset(name: str, n_layers: int, d_model: int, n_heads: int, d_vocab: int = 50304) -> ModelConfig:
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_vocab=d_vocab, n_ctx=2048, activation="gelu",
        tie_word_embeddings=False, family="gpt_neox", positional="rotary", rotary_dim=d_model // n_heads // 4,
        parallel_block=True, bos_token_id=0, eos_token_id=0, name=name,
    )


def llama_preset(name: str, family: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, d_vocab: int,
           n_ctx: int, tied: bool, base: float, d_head: int | None = None, **extra: Any) -> ModelConfig:
    fields = dict(norm="rmsnorm", mlp="swiglu", norm_eps=1e-5 if family in ("llama", "mistral", "phi3") else 1e-6,
                  fused_qkv=False, qk_norm=family == "qwen3")
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, d_mlp=d_mlp,
        d_vocab=d_vocab, n_ctx=n_ctx, tie_word_embeddings=tied, family=family, positional="rotary", rotary_base=base,
        qkv_bias=family == "qwen2", out_bias=False, name=name, **{**fields, **extra},
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


def gpt_oss_preset(name: str, n_layers: int, n_experts: int) -> ModelConfig:
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


def qwen3_5_preset(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, n_v_heads: int,
             tied: bool) -> ModelConfig:
    """Qwen 3.5 (dense), the text part of Qwen/Qwen3.5-*'s config.json (`text_config`; shapes from the published
    configs as recalled, cross-checked against Qwen3_5TextConfig's defaults, which are the 9B's): three Gated DeltaNet
    blocks (16 q/k heads of 128, value heads of 128) then one gated full-attention block (heads of 256, a quarter
    of each rotating, base 1e7), (1 + w) RMSNorms, a 248,320-token vocabulary, 262,144 positions."""
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=256, d_mlp=d_mlp,
        d_vocab=248320, n_ctx=262144, norm="rmsnorm_offset", norm_eps=1e-6, mlp="swiglu", tie_word_embeddings=tied,
        family="qwen3_5_text", positional="rotary", rotary_base=10_000_000.0, rotary_dim=64, fused_qkv=False,
        qkv_bias=False, out_bias=False, qk_norm=True, attn_output_gate=True,
        layer_types=tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(n_layers)), linear_n_k_heads=16,
        linear_n_v_heads=n_v_heads, linear_d_k=128, linear_d_v=128, linear_conv_width=4, eos_token_id=248044, name=name,
    )


GEMMA2_FIELDS = dict(attn_softcap=50.0, final_softcap=30.0)
GEMMA3_FIELDS = dict(qk_norm=True, rotary_base=1_000_000.0, local_rotary_base=10000.0)
LLAMA3_FIELDS = dict(rope_type="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_n_ctx=8192)
QWEN3_MOE_FIELDS = dict(qk_norm=True, routing="softmax_topk_renorm", n_experts=128, n_experts_per_token=8)
OLMOE_FIELDS = dict(qk_norm=True, qk_norm_per_head=False, norm_eps=1e-5, n_experts=64, n_experts_per_token=8,
              routing="softmax_topk", bos_token_id=None, eos_token_id=50279)
OLMO2_FIELDS = dict(qk_norm=True, qk_norm_per_head=False, norm_placement="post", norm_eps=1e-6, bos_token_id=None,
              eos_token_id=100257)


def gemma4_preset(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, full_n_kv_heads: int | None,
            d_mlp: int, window: int, n_ctx: int, pattern: int = 6, k_is_v: bool = True, **extra: Any) -> ModelConfig:
    """Gemma 4 (text): heads of 256 on the sliding blocks, of 512 on the full ones (one in `pattern`, and the last;
    with `k_is_v`, their own kv heads whose keys are the values), proportional rotary over a quarter of the full
    blocks' pairs (base 1e6), base 1e4 on the sliding ones, a final soft-cap of 30, a 262,144-token vocabulary;
    `extra`: per-layer inputs and kv sharing (E2B, E4B) or experts (26B-A4B). Shapes from the published config.json
    as recalled, not downloaded, checked against transformers' own models' totals (tests/test_gemma4_presets.py)."""
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=256, d_mlp=d_mlp,
        d_vocab=262144, n_ctx=n_ctx, norm="rmsnorm", norm_eps=1e-6, mlp="geglu", activation="gelu_pytorch_tanh",
        norm_placement="sandwich", scale_embed=True, tie_word_embeddings=True, family="gemma4_text", positional="rotary",
        rotary_base=1_000_000.0, local_rotary_base=10000.0, rope_type="proportional", rope_proportion=0.25,
        fused_qkv=False, qkv_bias=False, out_bias=False, query_pre_attn_scalar=1.0, qk_norm=True, v_norm=True,
        layer_scalar=True, sliding_window=window, full_d_head=512, full_n_kv_heads=full_n_kv_heads, full_k_is_v=k_is_v,
        layer_types=tuple("full" if (i + 1) % pattern == 0 or i == n_layers - 1 else "sliding" for i in range(n_layers)),
        final_softcap=30.0, bos_token_id=2, eos_token_id=1, name=name, **extra,
    )


def olmo3_preset(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int) -> ModelConfig:
    """OLMo 3: OLMo 2's block, three sliding-window blocks (window 4096) to one full, YaRN (x8 over 8192 tokens) on the
    full blocks only. Shapes from the published config.json files (allenai/Olmo-3-1025-7B, allenai/Olmo-3-1125-32B),
    written from memory, not downloaded; the window, pattern and base agree with Olmo3Config's defaults."""
    return llama_preset(name, "olmo3", n_layers, d_model, n_heads, n_kv_heads, d_mlp, 100278, 65536, False, 500000.0,
                  **OLMO2_FIELDS, rope_type="yarn", rope_factor=8.0, rope_original_n_ctx=8192,
                  rope_attention_factor=1.2079441541679836, local_rotary_base=500000.0, sliding_window=4096,
                  layer_types=tuple("full" if (i + 1) % 4 == 0 else "sliding" for i in range(n_layers)))

"""Accounting: counts against real modules and hand arithmetic, FLOPs against torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from fixtures import unchanged_copy
from torch.utils.flop_counter import FlopCounterMode

import lenskit
from lenskit import accounting
from lenskit.config import ModelConfig


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # .parameters() yields a tied weight once


def meta_model(cfg: ModelConfig) -> lenskit.HookedTransformer:
    with torch.device("meta"):  # shapes only: gpt2-xl without 6 GB of memory
        return lenskit.HookedTransformer(cfg)


# hand arithmetic: per block 12 d^2 + 13 d; embeddings V d + n_ctx d; final norm 2 d; tied unembedding
def gpt2_hand(L: int, d: int, V: int = 50257, n_ctx: int = 1024) -> dict[str, int]:
    per_block = 12 * d * d + 13 * d
    return {"per_block": per_block, "non_embedding": L * per_block + 2 * d,
            "total": V * d + n_ctx * d + L * per_block + 2 * d}


@pytest.mark.parametrize("name, L, d", [("gpt2", 12, 768), ("gpt2-xl", 48, 1600)])
def test_gpt2_presets_match_hand_arithmetic_and_real_modules(name, L, d):
    s = accounting.param_summary(name)["value"]
    hand = gpt2_hand(L, d)
    for key, value in hand.items():
        assert s[key] == value, key
    assert s["total"] == numel(meta_model(ModelConfig.from_name(name)))
    block = accounting.block_params(name)
    assert block.loc["attn", "weights"] == 4 * d * d and block.loc["mlp", "weights"] == 8 * d * d
    assert block.loc["attn", "biases"] == 4 * d and block.loc["mlp", "biases"] == 5 * d
    assert block.loc["norms", "params"] == 4 * d
    assert s["unembed"] == 0  # tied: counted once, in the embedding


def test_gpt2_small_reproduces_the_chapters_figures():
    s = accounting.param_summary("gpt2")["value"]
    assert s["total"] == 124_439_808  # the published size of GPT-2 small
    assert 84e6 < s["non_embedding"] < 86e6  # "about 85M"
    assert s["per_block_over_d2"] == pytest.approx(12 + 13 / 768)
    assert s["mlp_share_of_block"] == pytest.approx(2 / 3, abs=1e-3)

    row = accounting.accounting_row("gpt2", n_ctx=1024)
    assert row["dense_flops_over_params"] == pytest.approx(2.0, abs=0.02)  # FLOPs ~ 2 x params per token
    # attention core: 2 matmuls x 2 FLOPs x n_layers x n_ctx x d = 37,748,736 per token forward
    assert row["attn_core_flops_per_token"] == 4 * 12 * 1024 * 768
    assert row["attn_core_over_2n_nonembed"] == pytest.approx(4 * 12 * 1024 * 768 / (2 * 85_056_000))  # ~22%
    assert 0.20 < row["attn_core_over_2n_nonembed"] < 0.23 and 0.14 < row["attn_core_over_2n_total"] < 0.16


def test_gpt2_flops_by_hand():
    f = accounting.flops_per_token("gpt2", n_ctx=1024)
    d, L, V = 768, 12, 50257
    assert f.loc["attn_proj", "forward"] == 2 * L * 4 * d * d
    assert f.loc["mlp", "forward"] == 2 * L * 8 * d * d
    assert f.loc["unembed", "forward"] == 2 * d * V
    assert f.loc["total", "forward"] == 2 * L * 12 * d * d + 4 * L * 1024 * d + 2 * d * V
    assert (f["training"] == 3 * f["forward"]).all()
    assert f.loc[f.index != "total", "share"].sum() == pytest.approx(1.0)
    causal = accounting.flops_per_token("gpt2", n_ctx=1024, causal=True)
    assert causal.loc["attn_core", "forward"] == pytest.approx(4 * L * 512.5 * d)
    assert accounting.six_nd("gpt2", 1e9) == 6 * 85_056_000 * 1e9
    assert accounting.six_nd("gpt2", 1e9, non_embedding=False) == 6 * 124_439_808 * 1e9


@pytest.mark.parametrize("changes", [
    {},
    {"norm": "rmsnorm"},
    {"mlp": "swiglu", "d_mlp": 88},
    {"tie_word_embeddings": False},
    {"d_head": 5, "d_mlp": 50},  # d_attn = 20 != d_model
    {"norm": "rmsnorm_offset", "norm_placement": "sandwich", "mlp": "geglu", "qk_norm": True},  # Gemma 3's pieces
    {"norm": "rmsnorm", "norm_placement": "post", "qk_norm": True, "qk_norm_per_head": False, "n_kv_heads": 2},  # OLMo 2's
    {"norm": "rmsnorm", "mlp": "swiglu_fused", "d_mlp": 40},  # Phi-3's
])
def test_counts_equal_a_real_models_parameters(changes):
    cfg = ModelConfig(n_layers=3, d_model=32, n_heads=4, d_vocab=101, n_ctx=64).replace(**changes)
    model = lenskit.HookedTransformer(cfg)
    table = accounting.param_table(model)
    assert table.params.sum() == numel(model)
    assert accounting.param_summary(cfg).loc["total", "value"] == numel(model)
    per_block = accounting.block_params(cfg)
    assert per_block.loc["mlp", "params"] == numel(model.blocks[0].mlp)
    norms = sum(p.numel() for n, p in model.blocks[0].named_parameters() if n.startswith("ln") or "_norm." in n)
    assert per_block.loc["norms", "params"] == norms
    assert per_block.loc["attn", "params"] + per_block.loc["mlp", "params"] + norms == numel(model.blocks[0])
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith("bias"))
    assert table.biases.sum() == biases
    non_emb = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.", "ln_final.")))
    assert accounting.param_summary(cfg).loc["non_embedding", "value"] == non_emb


def test_flops_equal_torchs_flop_counter_on_a_real_forward():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=101, n_ctx=16)
    model = lenskit.HookedTransformer(cfg).eval()
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    # a no-op hook on the pattern selects the eager attention path, whose matmuls the counter sees
    eager = [(f"blocks.{i}.attn.hook_pattern", unchanged_copy) for i in range(cfg.n_layers)]
    with FlopCounterMode(display=False) as counter, model.hooks(eager):
        model(tokens)
    assert counter.get_total_flops() / tokens.numel() == accounting.flops_per_token(cfg)["forward"]["total"]


def test_accepts_models_configs_and_names_and_rejects_others():
    rows = accounting.compare({"small": "gpt2", "xl": ModelConfig.from_name("gpt2-xl")}, n_ctx=1024)
    assert list(rows.model) == ["small", "xl"] and rows.params.is_monotonic_increasing
    with pytest.raises(KeyError, match="no preset"):
        accounting.param_summary("gpt5")
    with pytest.raises(TypeError, match="expected a ModelConfig"):
        accounting.param_table(42)
    with pytest.raises(ValueError, match="n_ctx"):
        accounting.flops_per_token("gpt2", n_ctx=0)


# Each preset as transformers' own config class would read the published config.json (an independent
# spelling of the same shapes), so the counts are checked against transformers' model on the meta device.
_HF_PRESETS = {
    "pythia-70m": ("GPTNeoXConfig", dict(num_hidden_layers=6, hidden_size=512, num_attention_heads=8, intermediate_size=2048, vocab_size=50304)),
    "pythia-160m": ("GPTNeoXConfig", dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=50304)),
    "pythia-410m": ("GPTNeoXConfig", dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096, vocab_size=50304)),
    "pythia-1b": ("GPTNeoXConfig", dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=8, intermediate_size=8192, vocab_size=50304)),
    "pythia-1.4b": ("GPTNeoXConfig", dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=16, intermediate_size=8192, vocab_size=50304)),
    "pythia-2.8b": ("GPTNeoXConfig", dict(num_hidden_layers=32, hidden_size=2560, num_attention_heads=32, intermediate_size=10240, vocab_size=50304)),
    "pythia-6.9b": ("GPTNeoXConfig", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, intermediate_size=16384, vocab_size=50432)),
    "pythia-12b": ("GPTNeoXConfig", dict(num_hidden_layers=36, hidden_size=5120, num_attention_heads=40, intermediate_size=20480, vocab_size=50688)),
    "llama-3.2-1b": ("LlamaConfig", dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
    "llama-3.2-3b": ("LlamaConfig", dict(num_hidden_layers=28, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
    "llama-3.1-8b": ("LlamaConfig", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)),
    "mistral-7b": ("MistralConfig", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, head_dim=128)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)),
    "qwen2.5-7b": ("Qwen2Config", dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)),
    "qwen3-0.6b": ("Qwen3Config", dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)),
    "qwen3-1.7b": ("Qwen3Config", dict(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True)),
    "qwen3-4b": ("Qwen3Config", dict(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True)),
    "qwen3-8b": ("Qwen3Config", dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False)),
    "gemma-2-2b": ("Gemma2Config", dict(num_hidden_layers=26, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=256000)),
    "gemma-2-9b": ("Gemma2Config", dict(num_hidden_layers=42, hidden_size=3584, num_attention_heads=16, num_key_value_heads=8, head_dim=256, intermediate_size=14336, vocab_size=256000)),
    "gemma-3-1b": ("Gemma3TextConfig", dict(num_hidden_layers=26, hidden_size=1152, num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=6912, vocab_size=262144)),
    "gemma-3-4b": ("Gemma3TextConfig", dict(num_hidden_layers=34, hidden_size=2560, num_attention_heads=8, num_key_value_heads=4, head_dim=256, intermediate_size=10240, vocab_size=262208)),
    "olmo-2-1b": ("Olmo2Config", dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, intermediate_size=8192, vocab_size=100352, tie_word_embeddings=False)),
    "olmo-2-7b": ("Olmo2Config", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=100352, tie_word_embeddings=False)),
    "phi-3-mini": ("Phi3Config", dict(num_hidden_layers=32, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192, vocab_size=32064, tie_word_embeddings=False, pad_token_id=0)),
    "phi-4": ("Phi3Config", dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=10, intermediate_size=17920, vocab_size=100352, tie_word_embeddings=False, pad_token_id=100349)),
    "olmo-3-7b": ("Olmo3Config", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=100278, tie_word_embeddings=False)),
    "olmo-3-32b": ("Olmo3Config", dict(num_hidden_layers=64, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, intermediate_size=27648, vocab_size=100278, tie_word_embeddings=False)),
    "smollm3-3b": ("SmolLM3Config", dict(num_hidden_layers=36, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, intermediate_size=11008, vocab_size=128256, tie_word_embeddings=True)),
    "apertus-8b": ("ApertusConfig", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=21504, vocab_size=131072)),
    "apertus-70b": ("ApertusConfig", dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=43008, vocab_size=131072)),
    "gemma-4-31b": ("Gemma4TextConfig", dict(num_hidden_layers=60, hidden_size=5376, num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True, intermediate_size=21504, vocab_size=262144, hidden_size_per_layer_input=0, sliding_window=1024, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10)),
    "deepseek-v3": ("DeepseekV3Config", dict(max_position_embeddings=163840, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))),
    "qwen3-next-80b-a3b": ("Qwen3NextConfig", dict(intermediate_size=5120, max_position_embeddings=262144, bos_token_id=151643, eos_token_id=151645, rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))),
    "kimi-k2": ("DeepseekV3Config", dict(num_attention_heads=64, num_key_value_heads=64, vocab_size=163840, n_routed_experts=384, n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1, max_position_embeddings=131072, bos_token_id=163584, eos_token_id=163585, rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0, beta_fast=1.0, beta_slow=1.0))),
    "llama-4-scout": ("Llama4TextConfig", dict(max_position_embeddings=10485760, bos_token_id=200000, eos_token_id=200001, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position_embeddings=8192))),
    "llama-4-maverick": ("Llama4TextConfig", dict(max_position_embeddings=1048576, num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False, bos_token_id=200000, eos_token_id=200001)),
    # Falcon-H1: attention and a Mamba-2 mixer in every block (transformers' defaults: no gated norm, one group)
    **{name: ("FalconH1Config", dict(num_hidden_layers=L, hidden_size=d, num_attention_heads=h, num_key_value_heads=kv,
                                     head_dim=dh, intermediate_size=m, vocab_size=v, mamba_d_ssm=sh * sd, mamba_n_heads=sh,
                                     mamba_d_head=sd, mamba_d_state=n))
       for name, L, d, h, kv, dh, m, v, sh, sd, n in (
           ("falcon-h1-0.5b", 36, 1024, 8, 2, 64, 2048, 32784, 24, 64, 128),
           ("falcon-h1-1.5b", 24, 2048, 8, 2, 128, 4608, 65536, 48, 64, 256),
           ("falcon-h1-1.5b-deep", 66, 1280, 6, 2, 128, 3072, 65536, 24, 64, 256),
           ("falcon-h1-3b", 32, 2560, 10, 2, 128, 6144, 65536, 32, 128, 256),
           ("falcon-h1-7b", 44, 3072, 12, 2, 128, 12288, 130048, 24, 128, 256),
           ("falcon-h1-34b", 72, 5120, 20, 4, 128, 21504, 261120, 32, 128, 256))},
    "glm-4.5": ("Glm4MoeConfig", dict(num_hidden_layers=92, hidden_size=5120, head_dim=128, intermediate_size=12288, n_routed_experts=160, moe_intermediate_size=1536, routed_scaling_factor=2.5, first_k_dense_replace=3, use_qk_norm=True, attention_bias=True)),
    "glm-4.5-air": ("Glm4MoeConfig", dict(head_dim=128, attention_bias=True)),  # transformers' defaults are 4.5-Air's
    "glm-4.6": ("Glm4MoeConfig", dict(num_hidden_layers=92, hidden_size=5120, head_dim=128, intermediate_size=12288, n_routed_experts=160, moe_intermediate_size=1536, routed_scaling_factor=2.5, first_k_dense_replace=3, use_qk_norm=True, attention_bias=True, max_position_embeddings=202752)),
    # the remote-code spelling of nvidia/Nemotron-H-*-Base-8K's config.json (hybrid_override_pattern, mamba_* names)
    "nemotron-h-8b": ("NemotronHConfig", dict(hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=21504, vocab_size=131072, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, mamba_n_groups=8, mamba_d_conv=4, mamba_conv_bias=True, use_bias=False, mlp_bias=False, max_position_embeddings=8192)),
    "nemotron-h-47b": ("NemotronHConfig", dict(hybrid_override_pattern="M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M*-M--", hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=30720, vocab_size=131072, mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=256, mamba_n_groups=8, mamba_d_conv=4, mamba_conv_bias=True, use_bias=False, mlp_bias=False, max_position_embeddings=8192)),
    "nemotron-h-56b": ("NemotronHConfig", dict(hybrid_override_pattern="M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-", hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=32768, vocab_size=131072, mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=256, mamba_n_groups=8, mamba_d_conv=4, mamba_conv_bias=True, use_bias=False, mlp_bias=False, max_position_embeddings=8192)),
}
# Published sizes (model cards), to 2 significant digits, as a check on the table above.
_PUBLISHED_TOTAL = {"pythia-70m": 70e6, "pythia-160m": 162e6, "pythia-12b": 11.8e9, "llama-3.2-1b": 1.24e9,
                    "llama-3.1-8b": 8.03e9, "mistral-7b": 7.24e9, "qwen2.5-0.5b": 0.49e9, "qwen2.5-7b": 7.62e9,
                    "qwen3-0.6b": 0.6e9, "qwen3-8b": 8.2e9, "gemma-2-2b": 2.61e9, "gemma-2-9b": 9.24e9, "gemma-3-1b": 1.0e9,
                    "olmo-2-7b": 7.30e9, "phi-3-mini": 3.82e9, "olmo-3-7b": 7.30e9, "olmo-3-32b": 32.2e9, "smollm3-3b": 3.08e9,
                    "gemma-4-31b": 30.7e9, "apertus-8b": 8.05e9, "apertus-70b": 70.6e9, "phi-4": 14.7e9,
                    "deepseek-v3": 671e9, "kimi-k2": 1.04e12, "qwen3-next-80b-a3b": 80e9,
                    "llama-4-scout": 109e9, "llama-4-maverick": 400e9,  # Llama 4's cards count the vision encoder too
                    "falcon-h1-0.5b": 0.52e9, "falcon-h1-1.5b": 1.55e9,
                    "falcon-h1-1.5b-deep": 1.55e9, "falcon-h1-3b": 3.15e9, "falcon-h1-7b": 7.59e9, "falcon-h1-34b": 33.6e9,
                    "glm-4.5": 355e9, "glm-4.5-air": 106e9,  # GLM's totals count the MTP block transformers does not build
                    "nemotron-h-8b": 8.1e9, "nemotron-h-56b": 56e9}


@pytest.mark.parametrize("name", sorted(_HF_PRESETS))
def test_family_presets_count_what_transformers_builds(name):
    import transformers

    config_cls, kwargs = _HF_PRESETS[name]
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**kwargs))
    total = numel(hf)
    embed = hf.get_input_embeddings().weight.numel()
    head = 0 if hf.config.tie_word_embeddings else hf.get_output_embeddings().weight.numel()
    s = accounting.param_summary(name)["value"]
    assert s["total"] == total
    assert s["non_embedding"] == total - embed - head
    assert s["total"] == numel(meta_model(ModelConfig.from_name(name)))  # and what we build
    if name in _PUBLISHED_TOTAL:
        assert s["total"] == pytest.approx(_PUBLISHED_TOTAL[name], rel=0.03)


def test_flops_count_gqa_and_swiglu():
    cfg = ModelConfig.from_name("llama-3.1-8b")
    f = accounting.flops_per_token(cfg, n_ctx=1024)["forward"]
    d, kv = 4096, 8 * 128
    assert f["attn_proj"] == 2 * 32 * (d * d + 2 * d * kv + d * d)  # q and out full; k and v at 8 of 32 heads
    assert f["mlp"] == 2 * 32 * 3 * d * 14336  # gate, up, down
    assert f["attn_core"] == 4 * 32 * 1024 * 32 * 128  # every query head attends, GQA or not
    with torch.device("meta"):
        model = lenskit.HookedTransformer(cfg.replace(n_layers=1))
    per_block_weights = sum(p.numel() for n, p in model.blocks[0].named_parameters() if p.ndim == 2)
    assert f["attn_proj"] + f["mlp"] == 2 * 32 * per_block_weights


def test_gemma2_2b_preset_is_what_its_config_reads_as():
    """transformers' Gemma2Config defaults are gemma-2-2b's published config: the preset must read the same."""
    import dataclasses

    import transformers

    read = ModelConfig.from_hf_config(transformers.Gemma2Config().to_dict())
    preset = ModelConfig.from_name("gemma-2-2b")
    assert dataclasses.replace(read, name=preset.name, initializer_range=preset.initializer_range) == preset


def test_every_preset_states_total_and_active_parameters():
    """`lenskit info`'s table has total and active for every preset (issue 36): equal for a dense model, and for a
    mixture of experts the total less each MoE block's unchosen experts, which is strictly less."""
    for name, cfg in lenskit.PRESETS.items():
        s = accounting.param_summary(name)["value"]
        assert 0 < s["active"] <= s["total"] and s["active_non_embedding"] == s["active"] - (s["total"] - s["non_embedding"]), name
        assert (s["active"] < s["total"]) == (cfg.moe.n_experts is not None), name


@pytest.mark.parametrize("name, attn, mlp, norms", [
    ("nemotron-h-8b", "the Mamba-2 mixer", "none: a mixer-only block", "ln1 (one sublayer), the mixer's output norm"),
    ("qwen3.5-0.8b", "the Gated DeltaNet", "gate, fc_in, fc_out", "ln1 and ln2, the mixer's output norm"),
    ("falcon-h1-0.5b", "q, k, v and out projections (k, v: 2 of 8 heads), and the Mamba-2 mixer beside them",
     "gate, fc_in, fc_out", "ln1 and ln2"),
    ("gpt2", "q, k, v and out projections", "fc_in and fc_out", "ln1 and ln2"),
])
def test_block_notes_name_block_zeros_pieces(name, attn, mlp, norms):
    """The per-block rows' notes say what block 0 is made of: a Mamba-2 or DeltaNet block's mixer is not q, k, v."""
    notes = accounting.param_summary(name)["note"]
    assert notes["per_block_attn"].startswith(attn) and notes["per_block_mlp"].startswith(mlp)
    assert notes["per_block_norms"] == norms

"""Falcon-H1's own reading (golden parity, saving, presets' counts, cached generation and every test above the model run
through the registry: test_families.py, test_families_saving.py, test_accounting.py, test_generate_cache.py): the
published config.json reads as the preset, each muP multiplier sits where transformers applies it (checked on the hooks
against transformers' own modules), the weight views carry the multipliers, the stream still decomposes exactly, and
settings transformers' class would run differently are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from families import build_family_model, family_model_of

from lenskit import HookedTransformer, ModelConfig
from lenskit.config import MambaConfig, ScalesConfig

# tiiuae/Falcon-H1-0.5B-Base's config.json (as recalled; transformers 4.52 spelling, remote-code fields included)
PUBLISHED = {
    "architectures": ["FalconH1ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375, "attn_layer_indices": None, "bos_token_id": 1,
    "embedding_multiplier": 5.656854249492381, "eos_token_id": 11, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 2048, "key_multiplier": 0.390625,
    "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 128, "mamba_conv_bias": True, "mamba_d_conv": 4,
    "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1,
    "mamba_n_heads": 24, "mamba_norm_before_gate": False, "mamba_proj_bias": False, "mamba_rms_norm": False,
    "mamba_use_mlp": True, "max_position_embeddings": 16384, "mlp_bias": False, "mlp_expansion_factor": 8,
    "mlp_multipliers": [0.8838834764831844, 0.5859375], "model_type": "falcon_h1", "num_attention_heads": 8,
    "num_hidden_layers": 36, "num_key_value_heads": 2, "num_logits_to_keep": 1, "pad_token_id": 0,
    "projectors_bias": False, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000000000.0,
    "ssm_in_multiplier": 1.25, "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 32784,
}


def test_the_published_config_reads_as_the_preset():
    read = ModelConfig.from_hf_config(PUBLISHED)
    preset = ModelConfig.from_name("falcon-h1-0.5b")
    # a preset is the shape; the multipliers are each checkpoint's own, read from its config.json
    assert read.scales == ScalesConfig(embedding=5.656854249492381, logits=0.0390625, attention_in=1.0, key=0.390625,
                                       attention_out=0.9375, mlp_gate=0.8838834764831844, mlp_down=0.5859375)
    assert (read.mamba.in_multiplier, read.mamba.out_multiplier) == (1.25, 0.23570226039551587)
    assert read.mamba.multipliers == tuple(PUBLISHED["ssm_multipliers"])
    defaults = MambaConfig()
    shape = dataclasses.replace(read, name=preset.name, scales=ScalesConfig(), mamba=dataclasses.replace(
        read.mamba, in_multiplier=defaults.in_multiplier, multipliers=defaults.multipliers,
        out_multiplier=defaults.out_multiplier))
    assert shape == preset
    assert read.mamba.dt_max == float("inf")
    tagged = ModelConfig.from_hf_config({**PUBLISHED, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert tagged == read  # transformers' own files spell inf so


@pytest.mark.parametrize("change, words", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"attn_layer_indices": [0, 2]}, "attn_layer_indices"),
    ({"mamba_use_mlp": False}, "mamba_use_mlp"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mamba_d_head": 32}, "mamba_n_heads=24 x mamba_d_head=32"),
    ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
    ({"time_step_limit": [0.0]}, "time_step_limit"),
    ({"key_multiplier": None}, "key_multiplier"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}, "yarn"),
])
def test_settings_outside_the_model_are_refused_by_name(change, words):
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_hf_config({**PUBLISHED, **change})
    assert "\n" not in str(e.value)


def test_a_multiplier_no_piece_reads_is_refused():
    with pytest.raises(ValueError, match="key_multiplier apply to three separate q, k, v"):
        ModelConfig.from_name("gpt2").replace(key_multiplier=0.5)
    with pytest.raises(ValueError, match="mlp_gate_multiplier / mlp_down_multiplier apply to a dense SwiGLU"):
        ModelConfig.from_name("gpt2").replace(mlp_down_multiplier=0.5)
    with pytest.raises(ValueError, match="residual_multiplier=0.5 scales the writes .* sets kv_lora_rank"):
        ModelConfig.from_name("deepseek-v3").replace(residual_multiplier=0.5)


def _hf_outputs(hf, tokens, modules: dict[str, str]) -> dict[str, torch.Tensor]:
    """Block 0's submodules' outputs (and, for names ending in ":in", inputs) in transformers' own forward."""
    seen, handles = {}, []
    block = hf.model.layers[0]
    for key, path in modules.items():
        module = block.get_submodule(path)
        if key.endswith(":in"):
            handles.append(module.register_forward_pre_hook(
                lambda m, a, kw, key=key: seen.__setitem__(key, (a[0] if a else kw["hidden_states"]).clone()), with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(
                lambda m, a, out, key=key: seen.__setitem__(key, (out[0] if isinstance(out, tuple) else out).clone())))
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_each_multiplier_sits_where_transformers_applies_it():
    """Each hook against transformers' own module outputs and its config's multipliers (TINY sets every one away from 1)."""
    pair = family_model_of("falcon_h1")
    hf, model, c = pair.hf, pair.model, pair.hf.config
    tokens = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(1))
    theirs = _hf_outputs(hf, tokens, {"attn": "self_attn", "mamba": "mamba", "k": "self_attn.k_proj",
                                      "gate": "feed_forward.gate_proj", "mlp": "feed_forward", "attn:in": "self_attn"})
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        embed = hf.model.embed_tokens(tokens) * c.embedding_multiplier
    close = dict(atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["hook_embed"], embed, **close)
    torch.testing.assert_close(cache["blocks.0.hook_heads_out"], theirs["attn"] * c.attention_out_multiplier, **close)
    torch.testing.assert_close(cache["blocks.0.hook_mamba_out"], theirs["mamba"] * c.ssm_out_multiplier, **close)
    torch.testing.assert_close(cache["blocks.0.ln1.hook_normalized"] * c.attention_in_multiplier, theirs["attn:in"], **close)
    k = (theirs["k"] * c.key_multiplier).view(*tokens.shape, -1, c.head_dim)  # before rotary, as hook_k is
    torch.testing.assert_close(cache["blocks.0.attn.hook_k"], k, **close)
    torch.testing.assert_close(cache["blocks.0.mlp.hook_pre"], theirs["gate"] * c.mlp_multipliers[0], **close)
    torch.testing.assert_close(cache["blocks.0.hook_mlp_out"], theirs["mlp"], **close)


def test_the_weight_views_carry_the_multipliers():
    """`x @ W + b` is what the hooks show: the keys, each head's write, the MLP's gate and write, the logits."""
    model = family_model_of("falcon_h1").model
    tokens = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(2))
    logits, cache = model.run_with_cache(tokens, names_filter=lambda n: True)
    block = model.blocks[0]
    x = cache["blocks.0.ln1.hook_normalized"]
    k = torch.einsum("bpm,hmd->bphd", x, block.attn.W_K)[:, :, ::model.cfg.n_heads // model.cfg.n_kv_heads]
    torch.testing.assert_close(k, cache["blocks.0.attn.hook_k"], atol=1e-5, rtol=0)
    heads = torch.einsum("bphd,hdm->bpm", cache["blocks.0.attn.hook_z"], block.attn.W_O) + block.attn.b_O
    torch.testing.assert_close(heads, cache["blocks.0.hook_heads_out"], atol=1e-5, rtol=0)
    normed2 = cache["blocks.0.ln2.hook_normalized"]
    torch.testing.assert_close(normed2 @ block.mlp.W_gate, cache["blocks.0.mlp.hook_pre"], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.0.mlp.hook_post"] @ block.mlp.W_out + block.mlp.b_out,
                               cache["blocks.0.hook_mlp_out"], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["ln_final.hook_normalized"] @ model.W_U + model.b_U, logits, atol=1e-5, rtol=0)


def test_the_stream_decomposes_with_the_mixer_as_its_own_part():
    """Per head, each block's write is its heads, its Mamba-2 mixer's write and the rest (output biases, here none),
    summing exactly to the stream; direct logit attribution of those parts sums to the logit (multiplier included)."""
    from lenses.anatomy import direct_logit_attribution

    model = family_model_of("falcon_h1").model
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    logits, cache = model.run_with_cache(tokens, names_filter=lambda n: True)
    stack, labels = cache.decompose_resid(return_labels=True)
    last = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(stack.sum(0), last, atol=1e-5, rtol=0)
    frame = direct_logit_attribution(model, cache, token=5, pos=-1, per_head=True)
    assert "0_mamba_out" in set(frame["component"])
    mamba = frame[frame["component"] == "0_mamba_out"]
    assert mamba["attribution"].abs().max() > 0
    total = frame.groupby("batch")["attribution"].sum().to_numpy()
    assert total == pytest.approx(logits[:, -1, 5].detach().numpy(), abs=1e-4)
    assert total == pytest.approx(frame.attrs["logit"], abs=1e-4)


@pytest.mark.parametrize("switch", ["set_use_split_qkv_input", "set_use_attn_in"])
def test_per_head_inputs_are_refused_by_name(switch):
    model = build_family_model("falcon_h1").model
    with pytest.raises(ValueError, match="Mamba-2 mixer beside") as e:
        getattr(model, switch)(True)
    assert "\n" not in str(e.value) and "hook_q_input" not in model.hook_dict


def test_a_saved_config_reads_back_as_transformers_reads_it(tmp_path):
    model = family_model_of("falcon_h1").model
    model.save_pretrained(tmp_path)
    again = HookedTransformer.from_pretrained(tmp_path)
    assert again.cfg.scales == model.cfg.scales and again.cfg.mamba == model.cfg.mamba


@pytest.mark.parametrize("overrides", [
    dict(attention_bias=True, mlp_bias=True, projectors_bias=True, mamba_proj_bias=True),
    dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
    dict(mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_conv_bias=False, tie_word_embeddings=True),
    dict(time_step_limit=(0.05, 0.6), mamba_n_groups=1, mamba_d_ssm=None, mamba_expand=2, mamba_n_heads=8,
         mamba_d_head="auto"),
], ids=["biases", "norm-then-gate", "gate-then-norm-tied", "step-limits-expand"])
def test_config_variants_match_transformers(overrides):
    """Every bias, each gated-norm form, a tied head, clamped step sizes and a mixer width from mamba_expand: logits and
    every block's output equal transformers' (fp32)."""
    from conftest import make_hf_family

    hf = make_hf_family("falcon_h1", seed=4, **overrides)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith((".D", ".A_log")):
                p.add_(torch.randn_like(p) * 0.3)
    model = HookedTransformer.from_hf(hf)
    tokens = torch.randint(0, 101, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
        logits, cache = model.run_with_cache(tokens)
    for i in range(model.cfg.n_layers - 1):
        torch.testing.assert_close(cache["resid_post", i], out.hidden_states[i + 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)

"""Nemotron-H's own reading (golden parity, saving, presets' counts and every test above the model run through the
registry: test_families.py, test_families_saving.py, test_accounting.py): the published config.json reads as the
preset, each transformers layer is one block whose absent half writes zeros, the Mamba-2 state carried in the KV cache
continues a prompt as the whole prompt runs, and what does not apply to Mamba-2 or MLP-only blocks is refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from conftest import make_hf_family
from golden import max_diff
from safetensors.torch import load_file, save_file

from lenskit import HookedTransformer, KVCache, ModelConfig
from lenskit.intervene.interventions import Head, target_sites

# nvidia/Nemotron-H-8B-Base-8K's config.json (the remote-code spelling transformers 5 still reads)
PUBLISHED = {
    "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_head_dim": 128, "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2, "expand": 2,
    "hidden_dropout": 0.0, "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", "initializer_range": 0.02,
    "intermediate_size": 21504, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64, "mamba_hidden_act": "silu",
    "mamba_num_heads": 128, "mamba_proj_bias": False, "max_position_embeddings": 8192, "mlp_bias": False,
    "mlp_hidden_act": "relu2", "model_type": "nemotron_h", "n_groups": 8, "num_attention_heads": 32,
    "num_hidden_layers": 52, "num_key_value_heads": 8, "num_logits_to_keep": 1, "pad_token_id": 0,
    "rescale_prenorm_residual": True, "residual_in_fp32": False, "rms_norm_eps": 1e-05, "sliding_window": None,
    "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_limit": [0.0, float("inf")],
    "time_step_max": 0.1, "time_step_min": 0.001, "time_step_rank": 256, "torch_dtype": "bfloat16", "use_bias": False,
    "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": 131072,
}


def test_the_published_config_reads_as_the_preset():
    read = ModelConfig.from_hf_config(PUBLISHED)
    preset = ModelConfig.from_name("nemotron-h-8b")
    assert dataclasses.replace(read, name=preset.name) == preset
    assert read.layer_types[:5] == ("mamba", "mlp", "mamba", "mlp", "mamba") and read.layer_types.count("full") == 4
    # and as transformers 5 resolves it (layers_block_type, its own names)
    resolved = transformers.NemotronHConfig.from_dict(dict(PUBLISHED)).to_dict()
    assert dataclasses.replace(ModelConfig.from_hf_config(resolved), name=preset.name) == preset


def test_the_published_json_with_an_infinite_step_limit_reads(tmp_path):
    """config.json spells the open step limit `Infinity`, which Python's json reads as inf."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))
    assert "Infinity" in (tmp_path / "config.json").read_text()
    assert ModelConfig.from_json(tmp_path / "config.json").mamba.dt_max == float("inf")


@pytest.mark.parametrize("change, words", [
    ({"hybrid_override_pattern": "M-E*", "moe_latent_size": 16}, "moe_latent_size=16: the experts' latent projection"),
    ({"hybrid_override_pattern": "M-E*", "n_routed_experts": 6, "n_group": 4}, "n_routed_experts=6, n_group=4"),
    ({"hybrid_override_pattern": "M-X"}, "hybrid_override_pattern='M-X'"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act='gelu'"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu'"),
    ({"attention_head_dim": 64}, "attention_head_dim=64 and head_dim=128 disagree"),
    ({"n_groups": 3}, "mamba_num_heads=128 and n_groups=3"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
    ({"mamba_n_groups": 4}, "mamba_n_groups=4 and n_groups=8 disagree"),
])
def test_settings_outside_the_model_are_refused_by_name(change, words):
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_hf_config({**PUBLISHED, **change})
    assert "\n" not in str(e.value)


def test_each_layer_is_one_block_whose_absent_half_writes_zeros():
    hf = make_hf_family("nemotron_h", num_hidden_layers=3, layers_block_type=["linear_attention", "full_attention", "mlp"])
    model = HookedTransformer.from_hf(hf)
    assert [type(b.attn).__name__ for b in model.blocks] == ["Mamba2Mixer", "Attention", "NoMixer"]
    assert [type(b.mlp).__name__ for b in model.blocks] == ["NoMLP", "NoMLP", "GeluMLP"]
    assert [hasattr(b, "ln1") for b in model.blocks] == [True, True, False]
    tokens = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(tokens)
    assert not cache["blocks.0.hook_mlp_out"].any() and not cache["blocks.1.hook_mlp_out"].any()
    assert not cache["blocks.2.hook_attn_out"].any() and cache["blocks.2.hook_mlp_out"].abs().max() > 0
    # the accounting counts each block's one norm and one sublayer: exactly the built model's parameters
    from lenskit import accounting

    assert accounting.param_summary(model.cfg)["value"]["total"] == sum(p.numel() for p in model.parameters())


def test_the_multi_token_prediction_layers_are_left_unread(tmp_path):
    hf = make_hf_family("nemotron_h")
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert all(name.startswith(("backbone.", "lm_head.")) for name in tensors)  # transformers' own file names
    extra = {"mtp.layers.0.eh_proj.weight": torch.randn(32, 64), "mtp.layers.0.norm.weight": torch.randn(32)}
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = HookedTransformer.from_pretrained(tmp_path)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(model(tokens), hf(tokens).logits) < 1e-5


def test_the_carried_state_continues_a_prompt_past_the_chunk():
    """A prompt longer than two chunks in pieces through the KV cache (Mamba-2 blocks carry their convolution inputs and
    state, the attention block its keys) gives the whole prompt's logits, which are transformers'."""
    hf = make_hf_family("nemotron_h", num_hidden_layers=3, layers_block_type=["linear_attention", "full_attention", "mlp"],
                        max_position_embeddings=128)
    model = HookedTransformer.from_hf(hf)
    tokens = torch.randint(0, 101, (2, 45), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(tokens)
        assert max_diff(whole, hf(tokens).logits) < 1e-4
        cache = KVCache(model.cfg, batch_size=2)
        parts = [model(tokens[:, a:b], past_kv_cache=cache) for a, b in ((0, 20), (20, 21), (21, 33), (33, 45))]
    assert max_diff(torch.cat(parts, dim=1), whole) < 1e-4
    assert cache.n_pos == 45 and cache[0].state.shape == (2, 4, 8, 6)


def test_head_level_operations_on_other_blocks_are_refused_by_name():
    hf = make_hf_family("nemotron_h", num_hidden_layers=3, layers_block_type=["linear_attention", "full_attention", "mlp"])
    model = HookedTransformer.from_hf(hf)
    tokens = torch.randint(0, 101, (1, 6))
    for layer, kind in ((0, "Mamba-2"), (2, "MLP-only")):
        with pytest.raises(ValueError, match=f"block {layer} is a {kind}.* layer, which has no attention heads"):
            target_sites(model, Head(layer, 0))
        with pytest.raises(KeyError, match=f"block {layer} is a {kind}.*has no attention scores"):
            model.run_with_cache(tokens, names_filter=f"blocks.{layer}.attn.hook_pattern")
    assert target_sites(model, Head(1, 0))  # the attention block has heads
    with pytest.raises(ValueError, match=r"model.W_Q cannot stack.*blocks \[0, 2\]"):
        model.W_Q
    with pytest.raises(ValueError, match=r"model.W_in cannot stack.*blocks \[0, 1\] are mixer-only \(no MLP\)"):
        model.W_in


def test_a_moe_layer_is_transformers_and_counts_its_active_experts(tmp_path):
    """An "E" layer (Nemotron 3 Nano's): routed squared-ReLU experts chosen by grouped sigmoid scores with the correction
    bias, beside one shared MLP; golden at every residual write, through transformers' files and ours, its parameters
    and active parameters those of transformers' model, and its router's hooks what transformers' router returns."""
    from golden import assert_golden, hf_module_outputs

    from lenskit import accounting

    hf = make_hf_family("nemotron_h", num_hidden_layers=4, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                        moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.0)
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.is_moe_layer(1) and not model.cfg.is_moe_layer(3) and model.cfg.moe.d_shared == 24
    tokens = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(3))
    assert_golden(model, hf, tokens)
    hf.save_pretrained(tmp_path / "theirs")
    assert_golden(HookedTransformer.from_pretrained(tmp_path / "theirs"), hf, tokens)
    model.save_pretrained(tmp_path / "ours")
    again, info = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert_golden(model, again.eval(), tokens)
    counts = accounting.param_summary(model.cfg)["value"]
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    per_expert = 2 * 32 * 16  # up and down, no gate
    assert counts["active"] == counts["total"] - (8 - 2) * per_expert
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.1.mlp.hook_"))
    _, weights, indices = hf_module_outputs(hf, tokens, "mixer.gate")[1]
    ours = cache["blocks.1.mlp.hook_expert_indices"].reshape(-1, 2)
    assert torch.equal(ours.sort(-1).values, indices.sort(-1).values)
    assert max_diff(cache["blocks.1.mlp.hook_expert_weights"].reshape(-1, 2).sort(-1).values, weights.sort(-1).values) < 1e-6
    assert model.blocks[1].mlp.W_gate is None and model.blocks[1].mlp.W_in.shape == (8, 32, 16)

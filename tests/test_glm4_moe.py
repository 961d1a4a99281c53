"""GLM-4.5's own reading (golden parity, tied and untied, sharded and padded, saving, presets' counts and every test
above the model run through the registry: test_families.py, test_families_saving.py, test_accounting.py): the
published config.json files read as the presets, the variants the tiny model does not take (no q/k norms, no biases,
unnormalised weights, every block sparse) match transformers, a checkpoint's multi-token-prediction block is left
unread as transformers leaves it, and settings transformers cannot run are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import make_hf_family
from safetensors.torch import load_file, save_file

from lenskit import HookedTransformer, ModelConfig

# zai-org/GLM-4.5's config.json (transformers 4 spelling)
PUBLISHED = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": True, "vocab_size": 151552,
}
# zai-org/GLM-4.5-Air's: the same file at its own sizes, without q/k norms
AIR = {**PUBLISHED, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
       "n_routed_experts": 128, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "num_hidden_layers": 46,
       "use_qk_norm": False}
# zai-org/GLM-4.6's: GLM-4.5's over a longer context
GLM_4_6 = {**PUBLISHED, "max_position_embeddings": 202752}


@pytest.mark.parametrize("config, name", [(PUBLISHED, "glm-4.5"), (AIR, "glm-4.5-air"), (GLM_4_6, "glm-4.6")])
def test_the_published_configs_read_as_the_presets(config, name):
    read = ModelConfig.from_hf_config(config)
    preset = ModelConfig.from_name(name)
    assert dataclasses.replace(read, name=preset.name) == preset
    assert read.rope.dim == 64 and read.eos_token_id == 151329
    assert read.moe.dense_layers == tuple(range(config["first_k_dense_replace"]))


@pytest.mark.parametrize("change", [
    dict(use_qk_norm=False, attention_bias=False),
    dict(norm_topk_prob=False, first_k_dense_replace=0, n_group=1, topk_group=1),
    dict(n_shared_experts=2, routed_scaling_factor=1.0, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                             partial_rotary_factor=1.0)),
], ids=["plain-attention", "unnormalised-all-sparse", "two-shared-whole-rotary"])
def test_variants_match_transformers_at_every_residual_write(change):
    hf = make_hf_family("glm4_moe", seed=4, **change)
    model = HookedTransformer.from_hf(hf)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens, output_hidden_states=True)
        logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_pre"))
    assert (logits - theirs.logits).abs().max().item() < 1e-5
    for i in range(model.cfg.n_layers):  # transformers' hidden_states[i] is block i's input
        assert (cache[f"blocks.{i}.hook_resid_pre"] - theirs.hidden_states[i]).abs().max().item() < 1e-5
    assert model.cfg.attention.qk_norm == hf.config.use_qk_norm and model.cfg.moe.n_shared_experts == hf.config.n_shared_experts


@pytest.mark.parametrize("change, words", [
    ({"num_key_value_heads": 7}, "num_key_value_heads=7 must divide num_attention_heads=96"),
    ({"num_key_value_heads": None}, "num_key_value_heads"),
    ({"n_group": 3}, "n_routed_experts=160, n_group=3, topk_group=1"),
    ({"n_group": 40, "topk_group": 1}, "num_experts_per_tok=8"),  # 4 experts open for 8 choices
    ({"first_k_dense_replace": None}, "first_k_dense_replace"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 42}, "head_dim=42 and partial_rotary_factor"),  # an odd rotary width
    ({"n_routed_experts": 160, "num_local_experts": 128}, "n_routed_experts=160 and num_local_experts=128"),
])
def test_settings_outside_the_model_are_refused_by_name(change, words):
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_hf_config({**PUBLISHED, **change})
    assert "\n" not in str(e.value)


def test_the_multi_token_prediction_block_is_left_unread(tmp_path):
    """A published checkpoint holds one more block (`layers.92` of 92) for multi-token prediction, which no forward
    reads: loaded as transformers loads it, without it."""
    hf = make_hf_family("glm4_moe")
    hf.save_pretrained(tmp_path)
    n = hf.config.num_hidden_layers
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {f"model.layers.{n}.{name.removeprefix('model.layers.1.')}": t.clone() for name, t in tensors.items()
             if name.startswith("model.layers.1.")}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.randn(32, 64)
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == n
    model = HookedTransformer.from_pretrained(tmp_path)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-5

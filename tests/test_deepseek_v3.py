"""DeepSeek V3's own reading (golden parity, saving, presets' counts and every test above the model run through the
registry: test_families.py, test_families_saving.py, test_accounting.py): the published config.json reads as the
preset, a checkpoint's multi-token-prediction block is left unread as transformers leaves it, and settings transformers
cannot run (or runs by choosing among closed groups) are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import make_hf_family
from safetensors.torch import load_file, save_file

from lenskit import HookedTransformer, ModelConfig

# deepseek-ai/DeepSeek-V3's config.json (transformers 4 spelling, remote-code fields), less its fp8 quantization
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_the_published_config_reads_as_the_preset():
    read = ModelConfig.from_hf_config(PUBLISHED)
    preset = ModelConfig.from_name("deepseek-v3")
    assert dataclasses.replace(read, name=preset.name) == preset
    assert read.rope.mscale_all_dim == 1.0 and read.moe.dense_layers == (0, 1, 2)


@pytest.mark.parametrize("change, words", [
    ({"num_key_value_heads": 64}, "num_key_value_heads=64 must equal num_attention_heads=128"),
    ({"n_group": 64, "topk_group": 1}, "n_group=64, topk_group=1 and num_experts_per_tok=8"),  # 4 experts open
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"first_k_dense_replace": None}, "first_k_dense_replace"),
    ({"rope_scaling": {**PUBLISHED["rope_scaling"], "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
])
def test_settings_outside_the_model_are_refused_by_name(change, words):
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_hf_config({**PUBLISHED, **change})
    assert "\n" not in str(e.value)


def test_the_multi_token_prediction_block_is_left_unread(tmp_path):
    """A published checkpoint holds one more block (`layers.61` of 61) for multi-token prediction, which no forward
    reads: loaded as transformers loads it, without it."""
    hf = make_hf_family("deepseek_v3")
    hf.save_pretrained(tmp_path)
    n = hf.config.num_hidden_layers
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {f"model.layers.{n}.{name}": t.clone() for name, t in tensors.items() if name.startswith("model.layers.1.")
             for name in [name.removeprefix("model.layers.1.")]}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.randn(32, 64)
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == n
    model = HookedTransformer.from_pretrained(tmp_path)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-5

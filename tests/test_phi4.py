"""Phi-4 is a `phi3` model (Phi3ForCausalLM): its published config.json reads as the `phi-4` preset, and a tiny model
of its shape (grouped-query attention, every head's full width rotating at base 2.5e5, no sliding window) matches
transformers at the logits and every residual write, through save_pretrained too."""

from __future__ import annotations

import pytest
from conftest import make_hf_family
from golden import assert_golden

from lenskit import HookedTransformer, ModelConfig

# microsoft/phi-4's config.json, as published
PHI4 = {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 100257,
        "embd_pdrop": 0.0, "eos_token_id": 100265, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
        "intermediate_size": 17920, "max_position_embeddings": 16384, "model_type": "phi3", "num_attention_heads": 40,
        "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
        "pad_token_id": 100349, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 100352}

# Phi-4's shape, shrunk: 4 query heads per kv head, no window, full rotary at Phi-4's base
TINY_PHI4 = dict(num_key_value_heads=1, sliding_window=None, original_max_position_embeddings=64,
                 rope_parameters=dict(rope_type="default", rope_theta=250000.0))


def test_phi4_config_json_reads_as_the_preset():
    assert ModelConfig.from_hf_config(PHI4, name="phi-4") == ModelConfig.from_name("phi-4")
    cfg = ModelConfig.from_name("phi-4")
    assert (cfg.n_kv_heads, cfg.sliding_window, cfg.rope.dim, cfg.rope.base) == (10, None, 128, 250000.0)


@pytest.mark.parametrize("via_files", [False, True])
def test_a_phi4_shaped_model_matches_transformers(via_files, tokens, tmp_path):
    hf = make_hf_family("phi3", seed=21, **TINY_PHI4)
    assert hf.config.num_attention_heads // hf.config.num_key_value_heads == 4 and hf.config.sliding_window is None
    if via_files:
        hf.save_pretrained(tmp_path / "phi4", max_shard_size="20KB")  # sharded, as the 14B is
        assert len(list((tmp_path / "phi4").glob("*.safetensors"))) > 1
        model = HookedTransformer.from_pretrained(tmp_path / "phi4")
    else:
        model = HookedTransformer.from_hf(hf)
    cfg = model.cfg
    assert (cfg.family, cfg.n_kv_heads, cfg.sliding_window, cfg.rope.dim, cfg.rope.base) == ("phi3", 1, None, cfg.d_head, 250000.0)
    assert_golden(model, hf, tokens)


def test_phi4_mini_longrope_is_refused_by_name():
    mini = make_hf_family("phi3").config.to_dict() | {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 2, "long_factor": [1.0] * 2,
        "original_max_position_embeddings": 16}}
    with pytest.raises(ValueError, match="longrope") as e:
        ModelConfig.from_hf_config(mini)
    assert "\n" not in str(e.value)

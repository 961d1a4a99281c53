"""The registry (lenskit.families) and saving: presets and test tables derive from the registry, every preset's
config.json reads back in both libraries, and each family saves in its own layout, loading in transformers and back
(golden parity both ways); what a family's layout cannot express is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from conftest import FAMILIES, FAMILY_CONFIGS, make_hf_family
from families import NEVER_TIED
from golden import max_diff

from lenskit import PRESETS, HookedTransformer


def test_presets_and_test_tables_derive_from_the_registry():
    from families import FAMILY_BUILDERS

    import lenskit
    from lenskit.families import FAMILIES as REGISTRY

    assert FAMILIES == list(FAMILY_CONFIGS) == list(FAMILY_BUILDERS) == list(REGISTRY) == [
        "gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "phi3",
        "mixtral", "qwen3_moe", "olmoe", "gpt_oss", "olmo3", "smollm3", "qwen3_5_text", "gemma4_text", "apertus",
        "deepseek_v3", "qwen3_next", "llama4_text", "falcon_h1", "glm4_moe", "nemotron_h",
        "granitemoehybrid"]
    assert lenskit.PRESETS == {name: cfg for f in REGISTRY.values() for name, cfg in f.presets.items()}
    assert sum(len(f.presets) for f in REGISTRY.values()) == len(lenskit.PRESETS)  # no name in two families
    for model_type, family in REGISTRY.items():
        assert family.model_type == model_type and family.presets, model_type
        assert all(cfg.family == model_type and cfg.name == name == name.lower() for name, cfg in family.presets.items())
        assert isinstance(make_hf_family(model_type), getattr(transformers, family.hf_class))
        assert HookedTransformer.from_hf(make_hf_family(model_type)).cfg.family == model_type


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_writes_a_config_json_that_both_libraries_read_back(name):
    from lenskit import ModelConfig
    from lenskit.families import family_of

    preset = PRESETS[name]
    written = json.loads(json.dumps(preset.to_hf_dict()))  # as it is on disk
    assert written["architectures"] == [family_of(preset.family).hf_class] and written["model_type"] == preset.family
    assert ModelConfig.from_hf_config(written, name=name) == preset
    theirs = getattr(transformers, family_of(preset.family).hf_config_class).from_dict(written)
    assert ModelConfig.from_hf_config(theirs, name=name) == preset


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_our_save_loads_in_transformers_and_back(family, tied, tmp_path, tokens):
    """save_pretrained writes the family's own folder: transformers' class loads every tensor of it and
    computes our logits, and lenskit loads it back to the same model."""
    from lenskit.families import family_of

    ours = HookedTransformer.from_hf(make_hf_family(family, tie_word_embeddings=tied, seed=5))
    ours.save_pretrained(tmp_path / "saved")
    theirs, info = getattr(transformers, family_of(family).hf_class).from_pretrained(
        tmp_path / "saved", attn_implementation="eager", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert theirs.config.tie_word_embeddings == (tied and family not in NEVER_TIED)
    again = HookedTransformer.from_pretrained(tmp_path / "saved")
    assert dataclasses.replace(again.cfg, name=ours.cfg.name) == ours.cfg
    with torch.no_grad():
        logits = ours(tokens)
        assert max_diff(theirs.eval()(tokens).logits, logits) <= 1e-4
        assert torch.equal(again(tokens), logits)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_saved_gqa_llama_loads_in_llama_for_causal_lm(tied, tmp_path, tokens):
    hf = make_hf_family("llama", tie_word_embeddings=tied, num_key_value_heads=2, seed=6)
    ours = HookedTransformer.from_hf(hf)
    assert ours.cfg.n_kv_heads == 2 < ours.cfg.n_heads == 4
    ours.save_pretrained(tmp_path / "llama")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama", attn_implementation="eager").eval()
    with torch.no_grad():
        assert max_diff(theirs(tokens).logits, ours(tokens)) <= 1e-4
        assert max_diff(theirs(tokens).logits, hf(tokens).logits) <= 1e-4
        assert torch.equal(HookedTransformer.from_pretrained(tmp_path / "llama")(tokens), ours(tokens))


def test_saving_refuses_what_the_family_cannot_express(tmp_path):
    from lenskit.families import FAMILIES as REGISTRY

    cfg = HookedTransformer.from_hf(make_hf_family("llama")).cfg
    with pytest.raises(ValueError, match=r"model_type='llama' config.json cannot express out_bias=True"):
        dataclasses.replace(cfg, qkv_bias=False, out_bias=True).to_hf_dict()
    with pytest.raises(ValueError, match=r"cannot express norm='layernorm'"):
        HookedTransformer(dataclasses.replace(cfg, norm="layernorm")).save_pretrained(tmp_path / "layernorm")
    assert not (tmp_path / "layernorm").exists()  # nothing written
    with pytest.raises(ValueError, match=r"saving model_type='llama' in the Hugging Face layout is not implemented"):
        dataclasses.replace(REGISTRY["llama"], write=None).hf_config(cfg)

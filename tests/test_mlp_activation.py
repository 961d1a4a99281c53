"""The plain MLP's activation, chosen once at construction: ReLU beside the GELU forms. Golden parity against
transformers' own GPT-2 and GPT-NeoX with a ReLU config, the config's round trip through config.json and
save_pretrained, and the refusals (an unknown activation; ReLU in a gated MLP)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import make_hf_family
from golden import assert_golden, max_diff

from lenskit import HookedTransformer, ModelConfig

# What names the activation in each family's config.json.
ACTIVATION_FIELD = {"gpt2": "activation_function", "gpt_neox": "hidden_act"}


@pytest.mark.parametrize("family", sorted(ACTIVATION_FIELD))
def test_relu_mlp_matches_transformers(family, tokens):
    hf = make_hf_family(family, **{ACTIVATION_FIELD[family]: "relu"}, seed=6)
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.activation == "relu" and model.cfg.mlp == "gelu"
    assert_golden(model, hf, tokens)  # logits, and every resid_pre / attn_out / mlp_out / resid_post
    # the GELU model on the same weights differs: the activation is really applied, not a default
    gelu = HookedTransformer.from_hf(make_hf_family(family, seed=6))
    with torch.no_grad():
        assert max_diff(gelu(tokens), model(tokens)) > 1e-3


def test_relu_hooks_are_relu_of_the_pre_activation(tokens):
    model = HookedTransformer.from_hf(make_hf_family("gpt2", activation_function="relu", seed=7))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: ".mlp." in n)
    for layer in range(model.cfg.n_layers):
        pre, post = cache[f"blocks.{layer}.mlp.hook_pre"], cache[f"blocks.{layer}.mlp.hook_post"]
        assert (pre < 0).any() and torch.equal(post, pre.clamp(min=0))


@pytest.mark.parametrize("family", sorted(ACTIVATION_FIELD))
def test_relu_config_round_trips(family, tmp_path, tokens):
    ours = HookedTransformer.from_hf(make_hf_family(family, **{ACTIVATION_FIELD[family]: "relu"}, seed=8))
    written = json.loads(json.dumps(ours.cfg.to_hf_dict()))  # as it is on disk
    assert written[ACTIVATION_FIELD[family]] == "relu"
    assert ModelConfig.from_hf_config(written, name=ours.cfg.name) == ours.cfg
    ours.save_pretrained(tmp_path / "saved")
    theirs = getattr(transformers, type(make_hf_family(family)).__name__).from_pretrained(
        tmp_path / "saved", attn_implementation="eager").eval()
    again = HookedTransformer.from_pretrained(tmp_path / "saved")
    assert dataclasses.replace(again.cfg, name=ours.cfg.name) == ours.cfg
    with torch.no_grad():
        logits = ours(tokens)
        assert max_diff(theirs(tokens).logits, logits) <= 1e-4
        assert torch.equal(again(tokens), logits)


def test_gelu_forms_are_unchanged(tokens):
    """The GELU paths compute what they did: F.gelu with the config's approximation, bit for bit."""
    for act, approximate in (("gelu_new", "tanh"), ("gelu", "none")):
        model = HookedTransformer.from_hf(make_hf_family("gpt2", activation_function=act, seed=9))
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: ".mlp." in n)
        pre, post = cache["blocks.0.mlp.hook_pre"], cache["blocks.0.mlp.hook_post"]
        assert torch.equal(post, F.gelu(pre, approximate=approximate))


def test_unknown_and_misplaced_activations_are_refused_in_one_line():
    base = ModelConfig.from_hf_config(make_hf_family("gpt2").config)
    with pytest.raises(ValueError, match=r"activation='swish' is not an activation lenskit builds; supported: .*'relu'") as e:
        dataclasses.replace(base, activation="swish")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"activation='relu' is for the plain MLP \(mlp='gelu'\), got mlp='geglu'"):
        dataclasses.replace(base, mlp="geglu", activation="relu")
    config = make_hf_family("gpt2").config.to_dict() | {"activation_function": "swish"}
    with pytest.raises(ValueError, match="activation_function='swish' is not an activation lenskit builds"):
        ModelConfig.from_hf_config(config)

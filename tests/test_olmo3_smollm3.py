"""OLMo 3 and SmolLM3 beyond the family-parametrised tests: what makes each itself, against transformers' own classes.

OLMo 3: sliding and full blocks with their own rotary settings (the sliding ones plain, the full ones YaRN), read from
transformers 5's per-layer-type `rope_parameters` or the published files' 4.x spelling. SmolLM3: blocks without rotary
(`no_rope_layers`), and the optional sliding window on them. And every field either family refuses, by name.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from conftest import make_hf_family
from golden import assert_golden, max_diff

from lenskit import HookedTransformer, ModelConfig
from lenskit.pieces.attention import SlidingWindowMask
from lenskit.pieces.rotary import attention_factor, inverse_frequencies

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=1.2, beta_fast=32.0,
            beta_slow=1.0)


def tiny_config(family: str, **changes) -> dict:
    """The config.json transformers writes for the family's tiny model, with `changes` (None: the field removed)."""
    hf = make_hf_family(family)
    d = {**hf.config.to_dict(), "architectures": [type(hf).__name__]}
    d.update(copy.deepcopy(changes))
    return {k: v for k, v in d.items() if v is not None}


# ------------------------------------------------------------------ OLMo 3
def test_olmo3_blocks_take_their_layer_types_rotary_and_window(tokens):
    hf = make_hf_family("olmo3")
    model = HookedTransformer.from_hf(hf)
    cfg, rotary = model.cfg, hf.model.rotary_emb
    local, glob = model.blocks[0].attn, model.blocks[1].attn
    assert isinstance(local.mask, SlidingWindowMask) and local.mask.window == 5 < tokens.shape[1]
    assert not isinstance(glob.mask, SlidingWindowMask)
    # each block's frequencies and YaRN's cos/sin gain are transformers' for its layer type
    torch.testing.assert_close(inverse_frequencies(cfg, local=True), rotary.sliding_attention_inv_freq, rtol=1e-6, atol=0)
    torch.testing.assert_close(inverse_frequencies(cfg), rotary.full_attention_inv_freq, rtol=1e-6, atol=0)
    assert attention_factor(cfg, local=True) == rotary.sliding_attention_attention_scaling == 1.0
    assert attention_factor(cfg) == pytest.approx(rotary.full_attention_attention_scaling) and attention_factor(cfg) > 1.01
    # the sliding block's window bites: a wider one changes only what it sees past position 5
    wide = HookedTransformer.from_hf(make_hf_family("olmo3", sliding_window=64))
    with torch.no_grad():
        a, b = model(tokens), wide(tokens)
    assert max_diff(a[:, :5], b[:, :5]) <= 1e-5 and max_diff(a[:, 5:], b[:, 5:]) > 1e-3


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_olmo3_published_spelling_loads_with_parity(tied, tmp_path, tokens):
    """The hub's files say `rope_theta` and `rope_scaling` (YaRN) and leave `layer_types` to the default pattern:
    transformers 5 gives the scaling to the full blocks only (one in four), and so does lenskit."""
    make_hf_family("olmo3", num_hidden_layers=4, layer_types=None, tie_word_embeddings=tied, seed=7).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0, "rope_scaling": YARN}))
    theirs = transformers.Olmo3ForCausalLM.from_pretrained(tmp_path).eval()
    ours = HookedTransformer.from_pretrained(tmp_path)
    assert ours.cfg.layer_types == ("sliding", "sliding", "sliding", "full") == tuple(
        t.removesuffix("_attention") for t in theirs.config.layer_types)
    assert (ours.cfg.rope.type, ours.cfg.rope.attention_factor, ours.cfg.rope.local_base) == ("yarn", 1.2, 500000.0)
    assert_golden(ours, theirs, tokens)


# ------------------------------------------------------------------ SmolLM3
def test_smollm3_nope_blocks_have_no_rotary_and_it_matters(tokens):
    hf = make_hf_family("smollm3", num_hidden_layers=3)  # no_rope_layer_interval=2: block 1 has no rotary
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.nope_layers == (1,) and [a.use_rope for a in (b.self_attn for b in hf.model.layers)] == [1, 0, 1]
    assert not hasattr(model.blocks[1].attn, "rotary") and "blocks.1.attn.hook_rot_q" not in model.hook_dict
    assert "blocks.0.attn.hook_rot_q" in model.hook_dict and "blocks.2.attn.hook_rot_k" in model.hook_dict
    everywhere = make_hf_family("smollm3", num_hidden_layers=3, no_rope_layers=[1, 1, 1])
    ours_everywhere = HookedTransformer.from_hf(everywhere)
    assert ours_everywhere.cfg.nope_layers == ()
    for theirs, ours in ((hf, model), (everywhere, ours_everywhere)):
        assert_golden(ours, theirs, tokens)
    with torch.no_grad():  # the same weights, with and without rotary in block 1
        assert max_diff(model(tokens)[:, 1:], ours_everywhere(tokens)[:, 1:]) > 1e-3


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("spelling", ["use_sliding_window", "layer_types"])
def test_smollm3_sliding_window_blocks(spelling, tied, tokens):
    """With use_sliding_window the blocks without rotary are the sliding ones; a `layer_types` that says a block is
    sliding makes transformers' mask slide whatever use_sliding_window says, and lenskit reads it so."""
    fields = (dict(use_sliding_window=True) if spelling == "use_sliding_window"
              else dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    hf = make_hf_family("smollm3", num_hidden_layers=3, sliding_window=5, tie_word_embeddings=tied, **fields)
    model = HookedTransformer.from_hf(hf)
    want = ("full", "sliding", "full") if spelling == "use_sliding_window" else ("sliding", "full", "sliding")
    assert model.cfg.layer_types == want and model.cfg.sliding_window == 5 < tokens.shape[1]
    assert_golden(model, hf, tokens)
    unwindowed = HookedTransformer.from_hf(make_hf_family("smollm3", num_hidden_layers=3, tie_word_embeddings=tied))
    with torch.no_grad():
        a, b = model(tokens), unwindowed(tokens)
    assert max_diff(a[:, :5], b[:, :5]) <= 1e-5 and max_diff(a[:, 5:], b[:, 5:]) > 1e-3


def test_smollm3_yarn_rotary_has_parity(tokens):
    """SmolLM3's card extends its context with YaRN in rope_parameters."""
    hf = make_hf_family("smollm3", rope_parameters=dict(YARN, rope_theta=10000.0))
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.rope.type == "yarn"
    assert_golden(model, hf, tokens)


# ------------------------------------------------------------------ refused fields, one case each
REFUSED = [
    ("olmo3", {"hidden_act": "gelu"}, ("hidden_act='gelu'",)),
    ("olmo3", {"sliding_window": None, "layer_types": ["sliding_attention", "full_attention"]}, ("sliding_window=None",)),
    ("olmo3", {"layer_types": ["sliding_attention"]}, ("layer_types",)),
    ("olmo3", {"rope_parameters": {"sliding_attention": dict(YARN, rope_theta=100.0)}},
     ("rope_parameters.sliding_attention.rope_type='yarn'",)),
    ("olmo3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     ("sliding_attention", "'linear'")),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
     ("rope_parameters.full_attention.rope_type='dynamic'",)),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}}},
     ("partial_rotary_factor=0.5",)),
    ("olmo3", {"rope_parameters": None, "rope_theta": 1e4}, ("rope_theta=10000.0", "sliding_attention")),
    ("smollm3", {"hidden_act": "relu"}, ("hidden_act='relu'",)),
    ("smollm3", {"no_rope_layers": [1]}, ("no_rope_layers=[1]",)),
    ("smollm3", {"no_rope_layers": [1, 2]}, ("no_rope_layers=[1, 2]",)),
    ("smollm3", {"no_rope_layers": [True, False]}, ("no_rope_layers=[True, False]",)),
    ("smollm3", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": None}, ("sliding_window=None",)),
    ("smollm3", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     ("rope_type='longrope'",)),
]


@pytest.mark.parametrize("family, changes, words", REFUSED,
                         ids=[f"{f}-{'-'.join(sorted(c))}-{i}" for i, (f, c, _) in enumerate(REFUSED)])
def test_a_field_lenskit_does_not_implement_is_refused_by_name(family, changes, words):
    d = tiny_config(family)
    d.update(copy.deepcopy(changes))
    d = {k: v for k, v in d.items() if v is not None or k == "sliding_window"}
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(d)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_the_refused_cases_differ_from_the_tiny_models_only_in_the_refused_field():
    """The unchanged tiny configs load, so each refusal above is the field's doing."""
    for family in ("olmo3", "smollm3"):
        assert ModelConfig.from_hf_config(tiny_config(family)).family == family


def test_replace_continues_the_blocks_without_rotary():
    smollm3 = ModelConfig.from_name("smollm3-3b")
    assert smollm3.nope_layers == tuple(range(3, 36, 4))
    assert smollm3.replace(n_layers=42).nope_layers == tuple(range(3, 42, 4))
    assert smollm3.replace(n_layers=3).nope_layers == () and smollm3.replace(n_layers=4).nope_layers == (3,)
    with pytest.raises(ValueError, match="nope_layers"):
        smollm3.replace(nope_layers=(36,))


# The published config.json files as we remember them (not downloaded: CI has no network), in their 4.x spelling.
_OLMO3_7B = {
    "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "attention_bias": False, "attention_dropout": 0.0,
    "eos_token_id": 100257, "pad_token_id": 100277, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 65536, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "rms_norm_eps": 1e-06, "rope_theta": 500000, "sliding_window": 4096,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(32)],
    "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                     "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1},
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 100278,
}
_SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": None, "eos_token_id": 128012, "pad_token_id": 128004, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 65536, "max_window_layers": 28,
    "mlp_bias": False, "no_rope_layer_interval": 4, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
    "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 4, "pretraining_tp": 2,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
    "tie_word_embeddings": True, "use_cache": False, "use_sliding_window": False, "vocab_size": 128256,
}


@pytest.mark.parametrize("name, published", [("olmo-3-7b", _OLMO3_7B), ("smollm3-3b", _SMOLLM3_3B)])
def test_the_published_config_reads_as_the_preset_in_both_libraries(name, published):
    preset = ModelConfig.from_name(name)
    assert ModelConfig.from_hf_config(copy.deepcopy(published), name=name) == preset
    theirs = getattr(transformers, type(make_hf_family(preset.family).config).__name__).from_dict(copy.deepcopy(published))
    assert ModelConfig.from_hf_config(theirs, name=name) == preset  # as transformers 5 resolves the file

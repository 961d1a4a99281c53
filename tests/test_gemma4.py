"""Gemma 4 (text) beyond the family-parametrised tests: what makes it itself, against transformers' own classes.

Full blocks with wider heads and their own kv heads whose keys are also the values (`attention_k_eq_v`), a gainless
value norm, proportional rotary on the full blocks, each block's stored `layer_scalar` (our `hook_rescale_out`,
a write of its own in the stream's decomposition), and every Gemma 4 field lenskit refuses, by name. E2B/E4B's
per-layer inputs and kv sharing: tests/test_gemma4_small.py; 26B-A4B's experts: tests/test_gemma4_moe.py; the
published sizes: tests/test_gemma4_presets.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from conftest import make_hf_family
from fixtures import unchanged_copy
from golden import assert_golden, max_diff
from torch.utils.flop_counter import FlopCounterMode

from lenskit import HookedTransformer, ModelConfig, accounting
from lenskit.pieces.attention import SlidingWindowMask
from lenskit.pieces.qkv import KeyValueQK
from lenskit.pieces.rotary import inverse_frequencies


def tiny_config(**changes) -> dict:
    """The config.json transformers writes for the tiny Gemma 4, with `changes` (None: the field removed)."""
    d = {**make_hf_family("gemma4_text").config.to_dict(), "architectures": ["Gemma4ForCausalLM"]}
    d.update(copy.deepcopy(changes))
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_parity_tied_and_untied_through_the_saved_files(tied, tmp_path, tokens):
    make_hf_family("gemma4_text", num_hidden_layers=3, tie_word_embeddings=tied, seed=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]).save_pretrained(tmp_path)
    theirs = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = HookedTransformer.from_pretrained(tmp_path)
    assert ours.cfg.layer_types == ("sliding", "full", "full")  # transformers makes the last block full, and so do we
    assert ours.cfg.tie_word_embeddings == tied
    assert_golden(ours, theirs, tokens)


def test_full_blocks_have_their_own_heads_and_keys_as_values(tokens):
    hf = make_hf_family("gemma4_text")
    model = HookedTransformer.from_hf(hf)
    local, glob = model.blocks[0].attn, model.blocks[1].attn
    assert (local.d_head, local.n_kv_heads, glob.d_head, glob.n_kv_heads) == (16, 2, 24, 1)
    assert isinstance(glob.qkv, KeyValueQK) and not isinstance(local.qkv, KeyValueQK)
    assert hf.model.layers[1].self_attn.v_proj is None
    assert isinstance(local.mask, SlidingWindowMask) and local.mask.window == 5 < tokens.shape[1]
    _, cache = model.run_with_cache(tokens)
    assert cache["k", 1].shape == cache["v", 1].shape == (3, 17, 1, 24) and torch.equal(cache["k", 1], cache["v", 1])
    assert cache["z", 1].shape == (3, 17, 4, 24) and cache["z", 0].shape == (3, 17, 4, 16)
    # the value norm has no gain: each value head comes out with unit RMS
    v = cache["blocks.1.attn.v_norm.hook_normalized"]
    torch.testing.assert_close(v.pow(2).mean(-1), torch.ones(v.shape[:-1]), atol=1e-4, rtol=0)
    # ablating the keys' projection output changes the values too: they are one tensor
    hooks = [("blocks.1.attn.hook_k", lambda k, hook: torch.zeros_like(k))]
    assert max_diff(model.run_with_hooks(tokens, fwd_hooks=hooks), model(tokens)) > 1e-3


def test_proportional_rotary_is_transformers(tokens):
    """The full blocks' pairs span the whole (wider) head, and only the first quarter of them turn."""
    for full in (dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=10000.0),
                 dict(rope_type="proportional", partial_rotary_factor=0.5, rope_theta=500.0, factor=2.0),
                 dict(rope_type="default", rope_theta=1000.0)):
        params = {"sliding_attention": dict(rope_type="default", rope_theta=100.0), "full_attention": full}
        hf = make_hf_family("gemma4_text", rope_parameters=params)
        cfg = HookedTransformer.from_hf(hf).cfg
        rotary = hf.model.rotary_emb
        torch.testing.assert_close(inverse_frequencies(cfg, local=True), rotary.sliding_attention_inv_freq, rtol=1e-6, atol=0)
        ours = inverse_frequencies(cfg, dim=cfg.attention.full_d_head)
        torch.testing.assert_close(ours, rotary.full_attention_inv_freq, rtol=1e-6, atol=0)
        turning = int(full.get("partial_rotary_factor", 1.0) * 24 // 2)
        assert ours.shape == (12,) and (ours[turning:] == 0).all() and (ours[:turning] > 0).all()
        assert_golden(HookedTransformer.from_hf(hf), hf, tokens)


def test_layer_scalar_is_a_write_of_its_own(tokens):
    hf = make_hf_family("gemma4_text")
    model = HookedTransformer.from_hf(hf)
    scalars = [b.layer_scalar.item() for b in model.blocks]
    assert scalars == [layer.layer_scalar.item() for layer in hf.model.layers] and all(abs(s - 1) > 0.01 for s in scalars)
    _, cache = model.run_with_cache(tokens)
    for i, s in enumerate(scalars):  # the tiny model has per-layer inputs (E2B's): their write comes before the rescaling
        before = cache["resid_mid", i] + cache["mlp_out", i] + cache["per_layer_out", i]
        torch.testing.assert_close(cache["rescale_out", i], (s - 1) * before, atol=1e-6, rtol=0)
    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed", "0_attn_out", "0_mlp_out", "0_per_layer_out", "0_rescale_out", "1_attn_out", "1_mlp_out",
                      "1_per_layer_out", "1_rescale_out"]
    torch.testing.assert_close(stack.sum(0), cache["resid_post", 1], atol=1e-5, rtol=0)
    assert cache.decompose_resid(mode="mlp", incl_embeds=False).shape[0] == 2  # the late writes are neither sublayer's


def test_counts_and_flops_are_the_real_models():
    """Every block counted (the full blocks' wider q, k and out, no v), and the FLOPs torch counts."""
    cfg = HookedTransformer.from_hf(make_hf_family("gemma4_text", num_hidden_layers=3,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "full_attention"])).cfg
    model = HookedTransformer(cfg).eval()
    table = accounting.param_table(cfg)
    assert table.params.sum() == accounting.param_summary(cfg).loc["total", "value"] == sum(p.numel() for p in model.parameters())
    for layer, block in enumerate(model.blocks):
        assert accounting.block_params(cfg, layer).params.sum() == sum(p.numel() for p in block.parameters())
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = [(f"blocks.{i}.attn.hook_pattern", unchanged_copy) for i in range(cfg.n_layers)]
    with FlopCounterMode(display=False) as counter, model.hooks(eager):
        model(tokens)
    assert counter.get_total_flops() / tokens.numel() == accounting.flops_per_token(cfg, n_ctx=16)["forward"]["total"]


# ------------------------------------------------------------------ what lenskit refuses, by name
# Every size's pieces are implemented; what is refused is what transformers' own model cannot run either, or fields
# that would change the computation in a way lenskit does not implement (bidirectional attention over text).
REFUSED = [
    ({"num_kv_shared_layers": 2}, ("num_kv_shared_layers=2", "no block would compute the keys")),  # every block
    ({"num_kv_shared_layers": 1}, ("num_kv_shared_layers=1", "block 1 (full)", "no block before 1 has that type")),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}, ("enable_moe_block=True", "moe_intermediate_size")),
    ({"enable_moe_block": True, "num_experts": 2, "top_k_experts": 3, "moe_intermediate_size": 8},
     ("top_k_experts=3", "num_experts=2")),
    ({"vocab_size_per_layer_input": 50}, ("vocab_size_per_layer_input=50", "below vocab_size=101")),
    ({"use_bidirectional_attention": "all"}, ("use_bidirectional_attention='all'",)),
    ({"attn_logit_softcapping": 50.0}, ("attn_logit_softcapping=50.0",)),
    ({"rope_theta": 1e4}, ("rope_theta=10000.0",)),
    ({"hidden_activation": "relu"}, ("hidden_activation='relu'",)),
    ({"per_layer_config": {"0": {"head_dim": 24}, "1": {"head_dim": 24}}}, ("per_layer_config",)),
    ({"per_layer_config": {"1": {"head_dim": 24, "intermediate_size": 8}}}, ("per_layer_config",)),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}},
     ("rope_parameters.full_attention",)),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
                          "full_attention": {"rope_type": "proportional", "rope_theta": 1e4}}},
     ("sliding_attention.partial_rotary_factor",)),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                          "full_attention": {"rope_type": "proportional", "rope_theta": 1e4, "beta_fast": 2.0}}},
     ("rope_parameters.full_attention", "beta_fast")),
]


@pytest.mark.parametrize("changes, words", REFUSED, ids=[f"{'-'.join(sorted(c))}-{i}" for i, (c, _) in enumerate(REFUSED)])
def test_a_field_lenskit_does_not_implement_is_refused_by_name(changes, words):
    d = tiny_config(**changes)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(d)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("changes", [c for c, _ in REFUSED[:4]], ids=["all-shared", "no-source", "no-expert-width",
                                                                      "k-past-experts"])
def test_the_refused_sharing_and_experts_fail_in_transformers_too(changes):
    """What lenskit refuses of kv sharing and the experts, transformers' own model cannot build or run either."""
    d = tiny_config(**changes)
    # The behaviour is what counts, not the exception's type, which changes between releases (5.25 fails
    # all-shared with an AttributeError from its cache, earlier ones with a ValueError or an IndexError).
    with pytest.raises(Exception):  # noqa: B017
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig.from_dict(d)).eval()
        model(torch.randint(0, 101, (1, 5)))


def test_value_biases_do_not_fold_through_the_value_norm():
    """fold_value_biases moves b_V past the pattern, but Gemma 4's value norm sits between them: refused, by name."""
    model = HookedTransformer.from_hf(make_hf_family("gemma4_text", attention_bias=True))
    assert model.cfg.attention.qkv_bias and model.cfg.attention.v_norm
    with pytest.raises(ValueError, match="fold_value_biases is not exact for gemma4_text: the value norm"):
        model.process_weights(fold_ln=False, center_unembed=False, fold_value_biases=True)
    folded = model.process_weights(fold_ln=True, center_writing_weights=False, center_unembed=False,
                                   fold_value_biases=False)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    assert max_diff(folded(tokens), model(tokens)) <= 1e-4  # fold_ln does apply, biases and kv heads as they are


def test_the_refused_cases_differ_from_the_tiny_model_only_in_the_refused_field():
    assert ModelConfig.from_hf_config(tiny_config()).family == "gemma4_text"
    # the transformers 5 spelling (per_layer_config) and the hub's (global_head_dim, num_global_key_value_heads) agree
    hub = {k: v for k, v in tiny_config().items() if k != "per_layer_config"}
    hub.update(global_head_dim=24, num_global_key_value_heads=1)
    assert ModelConfig.from_hf_config(hub) == ModelConfig.from_hf_config(tiny_config())


# google/gemma-4-31B's text_config as published (recalled, not downloaded: CI has no network)
_GEMMA4_31B = {
    "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "hidden_size": 5376, "intermediate_size": 21504,
    "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4,
    "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": True, "sliding_window": 1024, "vocab_size": 262144,
    "max_position_embeddings": 262144, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
    "enable_moe_block": False, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "pad_token_id": 0, "use_bidirectional_attention": "vision",
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(60)],
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
}


def test_the_published_config_reads_as_the_preset_in_both_libraries():
    preset = ModelConfig.from_name("gemma-4-31b")
    assert ModelConfig.from_hf_config(copy.deepcopy(_GEMMA4_31B), name="gemma-4-31b") == preset
    theirs = transformers.Gemma4TextConfig.from_dict(copy.deepcopy(_GEMMA4_31B))
    assert ModelConfig.from_hf_config(theirs, name="gemma-4-31b") == preset  # as transformers 5 resolves the file
    assert json.loads(json.dumps(preset.to_hf_dict()))["global_head_dim"] == 512


def test_replace_keeps_the_scores_unscaled_and_the_full_blocks_own_heads():
    small = ModelConfig.from_name("gemma-4-31b").replace(n_layers=6, d_model=64, n_heads=4, n_kv_heads=2, d_head=16,
                                                          full_d_head=32, full_n_kv_heads=1, d_mlp=96, d_vocab=101)
    assert small.attention.query_pre_attn_scalar == 1.0 and small.layer_types == ("sliding",) * 5 + ("full",)
    assert (small.d_head_of(0), small.d_head_of(5), small.n_kv_heads_of(0), small.n_kv_heads_of(5)) == (16, 32, 2, 1)
    hf = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**small.to_hf_dict(), attn_implementation="eager"))
    ours = HookedTransformer.from_hf(hf.eval())
    assert ours.cfg == small.replace(name="custom", n_ctx=small.n_ctx)
    assert_golden(ours, hf, torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0)))

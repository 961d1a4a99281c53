"""TransformerLens 3's hook-point switches (lenskit.observe.switches): off by default, outputs unchanged with each on
(every family where it applies; a one-line refusal where it cannot), per-head edits against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch
from families import FAMILY_BUILDERS, build_family_model

SWITCHES = ("set_use_attn_result", "set_use_split_qkv_input", "set_use_attn_in", "set_use_hook_mlp_in")
TOKENS = torch.randint(0, 60, (2, 7), generator=torch.Generator().manual_seed(3))


def refusal(model, switch: str) -> str | None:
    """The refusal a switch must give on this model (None: it applies), read from the model's pieces."""
    if switch in ("set_use_attn_result", "set_use_hook_mlp_in"):
        return None
    if model.cfg.mla.kv_lora_rank is not None:  # DeepSeek V3: a norm between the stream and q, k, v
        return "attention is latent"
    if any(not hasattr(b.attn, "n_heads") or not hasattr(b.attn, "qkv") for b in model.blocks):
        return "layers, which have no per-head"
    if any(getattr(b.attn, "kv_source", None) is not None for b in model.blocks):
        return "kv sharing"
    if model.cfg.attention.output_gate:
        return "output gate"
    if switch == "set_use_attn_in" and any(b.attn.n_kv_heads != b.attn.n_heads for b in model.blocks):
        return "key/value heads for"
    return None


@pytest.mark.slow  # a model per family
@pytest.mark.parametrize("family", list(FAMILY_BUILDERS))
@torch.no_grad()
def test_each_switch_leaves_the_outputs_unchanged_or_is_refused(family):
    model = build_family_model(family).model
    clean = model(TOKENS)
    names = set(model.hook_dict)
    for switch in SWITCHES:
        why = refusal(model, switch)
        if why is not None:
            with pytest.raises(ValueError, match=why):
                getattr(model, switch)(True)
            assert set(model.hook_dict) == names  # nothing changed
            continue
        getattr(model, switch)(True)
        try:
            logits, cache = model.run_with_cache(TOKENS)
            assert (logits - clean).abs().max().item() < 1e-5, switch
            added = {"set_use_split_qkv_input": "hook_q_input", "set_use_attn_in": "hook_attn_in",
                     "set_use_hook_mlp_in": "hook_mlp_in", "set_use_attn_result": "attn.hook_result"}[switch]
            layer = next(l for l, b in enumerate(model.blocks) if (switch != "set_use_attn_result" or model.cfg.has_heads(l))
                         and (switch != "set_use_hook_mlp_in" or model.cfg.has_mlp(l)))
            assert f"blocks.{layer}.{added}" in cache, switch
        finally:
            getattr(model, switch)(False)
        assert set(model.hook_dict) == names
        assert torch.equal(model(TOKENS), clean)  # off again: the default path, the same numbers


def test_switches_are_off_by_default_and_their_points_absent():
    model = build_family_model("gpt2").model
    _, cache = model.run_with_cache(TOKENS)
    assert not any(n.endswith(("hook_result", "hook_q_input", "hook_attn_in", "hook_mlp_in")) for n in cache)
    with pytest.raises(KeyError, match=r"set_use_split_qkv_input\(True\)"):
        model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_q_input", lambda x, hook: None)])
    with pytest.raises(TypeError, match="True or False"):
        model.set_use_hook_mlp_in("yes")
    model.set_use_split_qkv_input(True)
    with pytest.raises(ValueError, match=r"set_use_split_qkv_input\(False\) first"):
        model.set_use_attn_in(True)


def hand_attention(model, layer: int, q_in, k_in, v_in):
    """Block `layer`'s attention write [batch, pos, d_model] by hand from per-head inputs [batch, pos, head | kv_head,
    d_model] (a GPT-2 or Llama-style block without rotary: GPT-2 here)."""
    block = model.blocks[layer]
    a = block.attn
    group = a.n_heads // a.n_kv_heads
    q = torch.einsum("bphm,hmd->bphd", block.ln1(q_in), a.W_Q) + a.b_Q
    kv_heads = torch.arange(a.n_heads) // group  # query head h reads kv head h // group
    k = torch.einsum("bphm,hmd->bphd", block.ln1(k_in)[:, :, kv_heads], a.W_K) + a.b_K
    v = torch.einsum("bphm,hmd->bphd", block.ln1(v_in)[:, :, kv_heads], a.W_V) + a.b_V
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(a.d_head)
    n = scores.shape[-1]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    z = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return torch.einsum("bphd,hdm->bpm", z, a.W_O) + a.b_O, z


@torch.no_grad()
def test_editing_one_heads_query_input_changes_only_that_head_as_by_hand():
    model = build_family_model("gpt2").model
    _, clean = model.run_with_cache(TOKENS)
    model.set_use_split_qkv_input(True)
    noise = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0))

    def edit(x, hook):
        x[:, :, 1] += noise  # in place, head 1's copy only
        return x

    _, cache = model.run_with_cache(TOKENS, fwd_hooks=[("blocks.0.hook_q_input", edit)])
    x = clean["blocks.0.hook_resid_pre"]
    per_head = x.unsqueeze(2).repeat(1, 1, 4, 1)
    q_in = per_head.clone()
    q_in[:, :, 1] += noise
    want, z = hand_attention(model, 0, q_in, per_head, per_head)
    torch.testing.assert_close(cache["blocks.0.hook_attn_out"], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["blocks.0.hook_q_input"], q_in)
    changed = (cache["blocks.0.attn.hook_z"] - clean["blocks.0.attn.hook_z"]).abs().amax(dim=(0, 1, 3))
    assert changed[1] > 1e-3 and (changed[[0, 2, 3]] < 1e-6).all()
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"], z, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], x)  # the stream itself is unchanged


@torch.no_grad()
def test_editing_one_kv_heads_input_changes_its_query_group_only():
    model = build_family_model("llama").model
    assert model.cfg.n_kv_heads < model.cfg.n_heads
    group = model.cfg.n_heads // model.cfg.n_kv_heads
    _, clean = model.run_with_cache(TOKENS)
    model.set_use_split_qkv_input(True)
    _, cache = model.run_with_cache(TOKENS, fwd_hooks=[("blocks.1.hook_v_input", lambda x, hook: x.index_fill(2, torch.tensor([0]), 0.0))])
    assert cache["blocks.1.hook_v_input"].shape[2] == model.cfg.n_kv_heads
    changed = (cache["blocks.1.attn.hook_z"] - clean["blocks.1.attn.hook_z"]).abs().amax(dim=(0, 1, 3))
    assert (changed[:group] > 1e-4).all() and (changed[group:] < 1e-6).all()
    assert (cache["blocks.1.attn.hook_v"][:, :, 0] == 0).all()  # an all-zero input: RMSNorm gives 0, and no bias


@torch.no_grad()
def test_attn_in_edit_is_read_by_query_key_and_value_as_by_hand():
    model = build_family_model("gpt2").model
    _, clean = model.run_with_cache(TOKENS)
    model.set_use_attn_in(True)
    _, cache = model.run_with_cache(TOKENS, fwd_hooks=[("blocks.1.hook_attn_in", lambda x, hook: x * torch.tensor([1.0, 1.0, 0.5, 1.0])[:, None])])
    per_head = clean["blocks.1.hook_resid_pre"].unsqueeze(2).repeat(1, 1, 4, 1)
    per_head[:, :, 2] *= 0.5
    want, _ = hand_attention(model, 1, per_head, per_head, per_head)
    torch.testing.assert_close(cache["blocks.1.hook_attn_out"], want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_attn_result_joins_the_default_names_and_sums_to_attn_out():
    model = build_family_model("gpt2").model
    clean = model(TOKENS)
    model.set_use_attn_result(True)
    logits, cache = model.run_with_cache(TOKENS)
    assert (logits - clean).abs().max().item() < 1e-5
    result = cache["blocks.1.attn.hook_result"]
    assert result.shape == (2, 7, 4, 32)
    torch.testing.assert_close(result.sum(2) + model.blocks[1].attn.b_O, cache["blocks.1.hook_attn_out"])
    model.set_use_attn_result(False)
    assert "blocks.1.attn.hook_result" not in model.run_with_cache(TOKENS)[1]


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "olmo2"])
@torch.no_grad()
def test_mlp_in_is_a_copy_of_what_the_mlp_reads(family):
    model = build_family_model(family).model
    model.set_use_hook_mlp_in(True)
    _, clean = model.run_with_cache(TOKENS)
    reads = "hook_resid_pre" if model.cfg.parallel_block else "hook_resid_mid"
    torch.testing.assert_close(clean["blocks.0.hook_mlp_in"], clean[f"blocks.0.{reads}"])
    _, cache = model.run_with_cache(TOKENS, fwd_hooks=[("blocks.0.hook_mlp_in", lambda x, hook: x.zero_())])
    torch.testing.assert_close(cache[f"blocks.0.{reads}"], clean[f"blocks.0.{reads}"])  # the stream is untouched
    block = model.blocks[0]
    zeros = torch.zeros(2, 7, model.cfg.d_model)
    by_hand = block.mlp(block.ln2(zeros)) if block.PRE_NORMS else block.ln2_post(block.mlp(zeros))
    torch.testing.assert_close(cache["blocks.0.hook_mlp_out"], by_hand)


def test_gradients_reach_the_stream_through_the_per_head_inputs():
    """resid_pre's gradient = resid_mid's (the residual path) + the sum over heads of the three per-head inputs'."""
    model = build_family_model("llama").model
    model.set_use_split_qkv_input(True)
    names = ["blocks.1.hook_resid_pre", "blocks.1.hook_resid_mid", *(f"blocks.1.{p}" for p in
                                                                     ("hook_q_input", "hook_k_input", "hook_v_input"))]
    _, cache = model.run_with_cache(TOKENS, names_filter=names, incl_bwd=True, return_type="loss")
    model.zero_grad(set_to_none=True)
    through_heads = sum(cache[f"blocks.1.{p}_grad"].sum(2) for p in ("hook_q_input", "hook_k_input", "hook_v_input"))
    assert cache["blocks.1.hook_k_input_grad"].shape[2] == model.cfg.n_kv_heads
    assert through_heads.abs().max() > 1e-6
    torch.testing.assert_close(cache["blocks.1.hook_resid_pre_grad"], cache["blocks.1.hook_resid_mid_grad"] + through_heads)

"""The hook-point switches against TransformerLens 4.3's bridge (compatibility mode) on the same tiny GPT-2, raw
weights: the same edit through `hook_q_input`, `hook_k_input`, `hook_v_input`, `hook_attn_in` or `hook_mlp_in`
gives the same logits, and the switched-on points hold the same activations."""

from __future__ import annotations

import pytest
import torch
from tl_fixtures import boot_bridge, tiny_gpt2_folder

import lenskit

RAW = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
TOKENS = torch.randint(0, 50000, (2, 6), generator=torch.Generator().manual_seed(0))
NOISE = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))


def shift_one_head(x, hook):
    """Position 3 of head 2's copy (the third axis is the head) moved along fixed noise; LayerNorm undoes a mere scale."""
    x = x.clone()
    x[:, 3, 2] += 3 * NOISE
    return x


def shift(x, hook):
    return x + NOISE[:, None]


@pytest.fixture(scope="module")
def pair():
    folder = tiny_gpt2_folder()
    return lenskit.HookedTransformer.from_pretrained(folder), boot_bridge(folder, **RAW)


CASES = [("set_use_split_qkv_input", "blocks.0.hook_q_input", shift_one_head),
         ("set_use_split_qkv_input", "blocks.1.hook_k_input", shift_one_head),
         ("set_use_split_qkv_input", "blocks.0.hook_v_input", shift_one_head),
         ("set_use_attn_in", "blocks.1.hook_attn_in", shift_one_head),
         ("set_use_hook_mlp_in", "blocks.0.hook_mlp_in", shift)]


@pytest.mark.slow  # boots the bridge
@pytest.mark.parametrize("switch,name,edit", CASES, ids=[c[1] for c in CASES])
@torch.no_grad()
def test_an_edit_through_a_switched_point_matches_the_bridge(pair, switch, name, edit):
    ours, bridge = pair
    clean = ours(TOKENS)
    for model in pair:
        getattr(model, switch)(True)
    try:
        mine = ours.run_with_hooks(TOKENS, fwd_hooks=[(name, edit)])
        theirs = bridge.run_with_hooks(TOKENS, fwd_hooks=[(name, edit)])
        # the edit mattered (a random tiny GPT-2's attention is near uniform, so q and k edits move logits little),
        # by hundreds of times the disagreement allowed
        assert (mine - clean).abs().max().item() > 1e-4
        assert (mine - theirs).abs().max().item() < 1e-6
        _, cache = ours.run_with_cache(TOKENS, names_filter=name)
        _, their_cache = bridge.run_with_cache(TOKENS, names_filter=name)
        assert cache[name].shape == their_cache[name].shape
        assert (cache[name] - their_cache[name]).abs().max().item() < 1e-6
    finally:
        for model in pair:
            getattr(model, switch)(False)


@pytest.mark.slow  # boots the bridge
@torch.no_grad()
def test_attn_result_matches_the_bridge(pair):
    ours, bridge = pair
    for model in pair:
        model.set_use_attn_result(True)
    try:
        _, cache = ours.run_with_cache(TOKENS)
        _, theirs = bridge.run_with_cache(TOKENS)
    finally:
        for model in pair:
            model.set_use_attn_result(False)
    for layer in range(2):
        name = f"blocks.{layer}.attn.hook_result"
        assert (cache[name] - theirs[name]).abs().max().item() < 1e-5

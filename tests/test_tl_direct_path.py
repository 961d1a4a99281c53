"""`lenskit.transformer_lens.patching.get_act_patch_direct_path` beside TransformerLens 4.3's own on its bridge (same
tiny GPT-2, TransformerLens's default processing), and against a hand computation of one path."""

from __future__ import annotations

import pytest
import torch
from tl_fixtures import boot_bridge, tiny_gpt2_folder

import lenskit.transformer_lens as ns
from lenskit.transformer_lens import patching as ours


@pytest.fixture(scope="module")
def setting():
    folder = tiny_gpt2_folder()
    model = ns.HookedTransformer.from_pretrained(str(folder))  # fold_ln, centred writes, as the bridge below
    clean = model.to_tokens(["The cat sat on", "A man ran to"])
    corrupted = model.to_tokens(["The dog sat on", "A girl ran to"])
    _, clean_cache = model.run_with_cache(clean)
    _, corrupted_cache = model.run_with_cache(corrupted)
    target = model(clean)[:, -1].detach()

    def metric(logits):
        return (logits[:, -1] - target).pow(2).sum(-1).mean()

    return model, folder, clean, corrupted, clean_cache, corrupted_cache, metric


@pytest.mark.parametrize("component", ["q", "k", "v"])
def test_direct_path_matches_transformer_lens(setting, component):
    from transformer_lens.patching import get_act_patch_direct_path as theirs

    model, folder, clean, corrupted, clean_cache, corrupted_cache, metric = setting
    bridge = boot_bridge(folder)
    _, their_clean = bridge.run_with_cache(clean)
    _, their_corrupted = bridge.run_with_cache(corrupted)
    want = theirs(bridge, corrupted, their_clean, their_corrupted, metric, 0, 1, component=component, verbose=False)
    got = ours.get_act_patch_direct_path(model, corrupted, clean_cache, corrupted_cache, metric, 0, 1,
                                         component=component, verbose=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0], torch.zeros(model.cfg.n_heads))  # layer 0 cannot be reached from layer 0
    if component == "v":  # the tiny model's patterns are near uniform, so queries and keys move the metric least
        assert float(got[1].max() - got[1].min()) > 1e-4  # the heads differ, so a head out of place would show


def test_one_path_by_hand(setting):
    model, _, clean, corrupted, clean_cache, corrupted_cache, metric = setting
    got = ours.get_act_patch_direct_path(model, corrupted, clean_cache, corrupted_cache, metric, 0, 2, verbose=False)
    # Head (1, 3)'s query from block 1's corrupted input plus head (0, 2)'s clean-minus-corrupted write, through
    # ln1 computed here (mean and standard deviation of the shifted input, not read from the cache).
    W_O, W_Q, b_Q = model.blocks[0].attn.W_O[2], model.blocks[1].attn.W_Q[3], model.blocks[1].attn.b_Q[3]
    write = lambda cache: cache["blocks.0.attn.hook_z"][:, :, 2] @ W_O  # noqa: E731
    x = corrupted_cache["blocks.1.hook_resid_pre"]
    shifted = x + write(clean_cache) - write(corrupted_cache)
    std = (shifted.var(-1, unbiased=False, keepdim=True) + model.cfg.eps).sqrt()
    q = ((shifted - shifted.mean(-1, keepdim=True)) / std * model.blocks[1].ln1.weight + model.blocks[1].ln1.bias) @ W_Q + b_Q

    def set_q(value, hook):
        value = value.clone()
        value[:, :, 3] = q
        return value

    want = metric(model.run_with_hooks(corrupted, fwd_hooks=[("blocks.1.attn.hook_q", set_q)]))
    torch.testing.assert_close(got[1, 3], want, atol=1e-5, rtol=1e-5)
    assert not any(getattr(b, "_input_switch", None) for b in model.blocks)  # the switch is off again
    # No difference between the runs, no effect: every reachable head gives the corrupted run's metric.
    same = ours.get_act_patch_direct_path(model, corrupted, corrupted_cache, corrupted_cache, metric, 0, 2, verbose=False)
    torch.testing.assert_close(same[1], metric(model(corrupted)).expand(model.cfg.n_heads))


def test_bad_input_is_refused_in_one_line(setting):
    model, _, _, corrupted, clean_cache, corrupted_cache, metric = setting
    with pytest.raises(ValueError, match="component must be"):
        ours.get_act_patch_direct_path(model, corrupted, clean_cache, corrupted_cache, metric, 0, 0, component="z")
    with pytest.raises(ValueError, match="outside this model"):  # nothing run, nothing switched
        ours.get_act_patch_direct_path(model, corrupted, clean_cache, corrupted_cache, metric, 5, 0)


def test_the_demo_s_module_path():
    from lenskit.transformer_lens.direct_path_patching import get_act_patch_direct_path

    assert get_act_patch_direct_path is ours.get_act_patch_direct_path

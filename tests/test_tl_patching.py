"""`lenskit.transformer_lens.patching` beside TransformerLens 4.3's own `transformer_lens.patching` on its bridge: the
same tiny GPT-2 checkpoint, the same clean and corrupted prompts (GPT-2's tokenizer), the same metric, every function,
with TransformerLens's default processing and with none."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from tl_fixtures import boot_bridge, tiny_gpt2_folder

import lenskit
from lenskit.transformer_lens import patching as ours

pytestmark = pytest.mark.slow  # two bridges, and each sweep over every layer, head and position twice

ATOL = 1e-5
SWEEPS = [
    "get_act_patch_resid_pre", "get_act_patch_resid_mid", "get_act_patch_attn_out", "get_act_patch_mlp_out",
    "get_act_patch_attn_head_out_by_pos", "get_act_patch_attn_head_q_by_pos", "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_v_by_pos", "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos", "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_q_all_pos", "get_act_patch_attn_head_k_all_pos", "get_act_patch_attn_head_v_all_pos",
    "get_act_patch_attn_head_pattern_all_pos", "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every", "get_act_patch_block_every",
]
LAYOUTS = {  # the result's axes, as TransformerLens documents them
    "resid_pre": "layer pos", "resid_mid": "layer pos", "attn_out": "layer pos", "mlp_out": "layer pos",
    "by_pos": "layer pos head", "pattern_by_pos": "layer head pos", "dest_src_pos": "layer head pos pos",
    "all_pos": "layer head", "all_pos_every": "5 layer head", "by_pos_every": "5 layer pos head",
    "block_every": "3 layer pos",
}
NO_PROCESSING = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)


def layout(name: str) -> str:
    return next(v for k, v in sorted(LAYOUTS.items(), key=lambda kv: -len(kv[0])) if name.endswith(k))


@pytest.fixture(scope="module", params=["processed", "raw"])
def pairing(request):
    """(TransformerLens's bridge, lenskit's model, tokens) on the same weights: default processing, or none."""
    folder = tiny_gpt2_folder()
    if request.param == "processed":
        bridge = boot_bridge(folder)
        model = lenskit.HookedTransformer.from_pretrained(str(folder), fold_ln=True, center_writing_weights=True,
                                                          center_unembed=True, fold_value_biases=True)
    else:
        bridge = boot_bridge(folder, **NO_PROCESSING)
        model = lenskit.HookedTransformer.from_pretrained(str(folder))
    clean = bridge.to_tokens(["The cat sat on", "A man ran to"])  # BOS first, as TransformerLens tokenises
    corrupted = bridge.to_tokens(["The dog sat on", "A girl ran to"])
    assert clean.shape == corrupted.shape == (2, 5)
    return bridge, model, clean, corrupted


@pytest.fixture(scope="module")
def results(pairing):
    """name -> (TransformerLens's result, ours), every sweep run once per pairing."""
    import transformer_lens.patching as theirs

    bridge, model, clean, corrupted = pairing
    _, their_cache = bridge.run_with_cache(clean)
    _, our_cache = model.run_with_cache(clean)
    # The metric: how far the last position's logits are from the clean run's (summed over the vocabulary: the tiny
    # model's logits move little, and a logit difference of two tokens would hardly move at all)
    target = bridge(clean)[:, -1].detach()

    def metric(logits):
        return (logits[:, -1] - target).pow(2).sum(-1).mean()

    return {name: (getattr(theirs, name)(bridge, corrupted, their_cache, metric),
                   getattr(ours, name)(model, corrupted, our_cache, metric)) for name in SWEEPS}


@pytest.mark.parametrize("name", [n for n in SWEEPS if n != "get_act_patch_resid_mid"])
def test_every_sweep_matches_transformer_lens(results, pairing, name):
    want, got = results[name]
    model = pairing[1]
    sizes = {"layer": model.cfg.n_layers, "pos": 5, "head": model.cfg.n_heads, "5": 5, "3": 3}
    assert tuple(got.shape) == tuple(sizes[a] for a in layout(name).split())
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    # The cells differ (q's least: the tiny model's patterns are near uniform), so a cell out of place would show.
    assert float(want.max() - want.min()) > 20 * ATOL


def test_resid_mid_is_the_whole_stream_where_the_bridge_patches_only_the_mlp_input(results):
    """TransformerLens 4.3's bridge hooks resid_mid at the input of the second norm, so its patch reaches the MLP
    but not the residual skip, and its resid_mid sweep equals its mlp_out sweep. lenskit patches the stream
    itself: with all of the clean resid_mid patched in at the last block, the clean logits come back exactly."""
    want, got = results["get_act_patch_resid_mid"]
    torch.testing.assert_close(want, results["get_act_patch_mlp_out"][0], atol=ATOL, rtol=0)
    assert not torch.allclose(got, want, atol=1e-3)
    # lenskit's cells at the last position: the stream there after the last attention carries the clean answer
    torch.testing.assert_close(got[-1, -1], torch.tensor(0.0), atol=ATOL, rtol=0)


def test_generic_patch_with_an_index_df_and_a_setter_of_ones_own(pairing):
    import transformer_lens.patching as theirs

    bridge, model, clean, corrupted = pairing
    _, their_cache = bridge.run_with_cache(clean)
    _, our_cache = model.run_with_cache(clean)
    metric = lambda logits: logits[:, -1, 262].mean() - logits[:, -1, 257].mean()  # noqa: E731

    def halfway(corrupted_activation, index, clean_activation):  # written the TransformerLens way: in place
        layer, pos = index
        corrupted_activation[:, pos] = (corrupted_activation[:, pos] + clean_activation[:, pos]) / 2
        return corrupted_activation

    index_df = ours.make_df_from_ranges([2, 5], ["layer", "pos"]).iloc[[7, 0, 3, 9]]
    for setter, name in [(halfway, "resid_post"), (ours.layer_pos_patch_setter, "z")]:
        want, want_df = theirs.generic_activation_patch(bridge, corrupted, their_cache, metric,
                                                        getattr(theirs, setter.__name__, setter), name,
                                                        index_df=index_df, return_index_df=True)
        got, got_df = ours.generic_activation_patch(model, corrupted, our_cache, metric, setter, name,
                                                    index_df=index_df, return_index_df=True)
        assert got.shape == (4,) and got_df is index_df
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    pd.testing.assert_frame_equal(ours.make_df_from_ranges([2, 3], ["a", "b"]), theirs.make_df_from_ranges([2, 3], ["a", "b"]))


def test_a_transformer_lens_notebook_runs_with_one_import_changed(pairing, results, request):
    """The namespace's HookedTransformer (TransformerLens's defaults: BOS first; from_pretrained processes the
    weights, from_pretrained_no_processing does not) and its patching, on text tokenised by the model itself, give
    TransformerLens's numbers."""
    from lenskit.transformer_lens import HookedTransformer, patching

    load = HookedTransformer.from_pretrained if "processed" in request.node.callspec.id else \
        HookedTransformer.from_pretrained_no_processing
    bridge, _, clean, corrupted = pairing
    model = load(str(tiny_gpt2_folder()))
    assert torch.equal(model.to_tokens(["The cat sat on", "A man ran to"]), clean)
    _, clean_cache = model.run_with_cache(model.to_tokens(["The cat sat on", "A man ran to"]))
    target = bridge(clean)[:, -1].detach()
    got = patching.get_act_patch_block_every(model, model.to_tokens(["The dog sat on", "A girl ran to"]), clean_cache,
                                             lambda logits: (logits[:, -1] - target).pow(2).sum(-1).mean())
    torch.testing.assert_close(got, results["get_act_patch_block_every"][0], atol=ATOL, rtol=1e-5)

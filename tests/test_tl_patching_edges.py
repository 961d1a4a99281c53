"""`lenskit.transformer_lens.patching` without a bridge: its layouts against lenskit.patching's own sweep on
grouped-query attention, the zero padding of the `*_every` stacks, linear-attention blocks, and bad input."""

from __future__ import annotations

import pytest
import torch
from families import family_model_of

from lenskit.intervene.patching import activation_patching, logit_diff
from lenskit.transformer_lens import patching as tl

N_POS = 5


@pytest.fixture(scope="module")
def llama():
    model = family_model_of("llama").model  # 3 layers, 4 heads, 2 kv heads
    clean = torch.randint(0, model.cfg.d_vocab, (2, N_POS), generator=torch.Generator().manual_seed(4))
    corrupted = clean.clone()
    corrupted[:, 1] = (clean[:, 1] + 11) % model.cfg.d_vocab
    _, cache = model.run_with_cache(clean)
    return model, clean, corrupted, cache


def test_head_layouts_are_lenskit_sweeps_rearranged_with_kv_heads_for_k_and_v(llama):
    model, clean, corrupted, cache = llama
    metric = logit_diff(3, 7)
    df = activation_patching(model, clean, corrupted, metric, sites=["head", "k", "pattern"], progress=False)
    table = df.set_index(["site", "layer", "position", "head"])["metric"]

    def expected(site, shape, key):
        return torch.tensor([table[(site, *key(i))] for i in torch.cartesian_prod(*map(torch.arange, shape)).tolist()],
                            dtype=torch.float32).reshape(shape)

    L, H, KV = model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_kv_heads
    z = tl.get_act_patch_attn_head_out_by_pos(model, corrupted, cache, metric)  # [layer, pos, head]
    torch.testing.assert_close(z, expected("head", (L, N_POS, H), lambda i: i), atol=1e-6, rtol=0)
    k = tl.get_act_patch_attn_head_k_by_pos(model, corrupted, cache, metric)  # [layer, pos, kv_head]
    torch.testing.assert_close(k, expected("k", (L, N_POS, KV), lambda i: i), atol=1e-6, rtol=0)
    pattern = tl.get_act_patch_attn_head_pattern_by_pos(model, corrupted, cache, metric)  # [layer, head, dest_pos]
    torch.testing.assert_close(pattern, expected("pattern", (L, H, N_POS), lambda i: (i[0], i[2], i[1])), atol=1e-6, rtol=0)


def test_every_stack_pads_kv_heads_with_zeros(llama):
    model, _, corrupted, cache = llama
    metric = logit_diff(3, 7)
    every = tl.get_act_patch_attn_head_all_pos_every(model, corrupted, cache, metric)
    assert every.shape == (5, model.cfg.n_layers, model.cfg.n_heads)
    kv = model.cfg.n_kv_heads
    for i, sweep in [(2, tl.get_act_patch_attn_head_k_all_pos), (3, tl.get_act_patch_attn_head_v_all_pos)]:
        torch.testing.assert_close(every[i, :, :kv], sweep(model, corrupted, cache, metric))
        assert (every[i, :, kv:] == 0).all()
    assert (every[[0, 1, 4]] != 0).all()


def test_head_sweeps_refuse_linear_attention_blocks_and_run_on_an_index_df_of_full_ones():
    model = family_model_of("qwen3_5_text").model  # blocks: linear, full, linear
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 4), generator=torch.Generator().manual_seed(1))
    _, cache = model.run_with_cache(tokens)
    metric = logit_diff(1, 2)
    with pytest.raises(ValueError, match=r"^site 'q': block 0 is a linear-attention \(Gated DeltaNet\) layer, which has no "
                                         r"attention heads; .*\(\[1\]\)$"):
        tl.get_act_patch_attn_head_q_all_pos(model, tokens, cache, metric)
    index_df = tl.make_df_from_ranges([1, 4], ["layer", "head"]).assign(layer=1)
    got = tl.generic_activation_patch(model, tokens, cache, metric, tl.layer_head_vector_patch_setter, "q", index_df=index_df)
    assert got.shape == (4,)
    clean_metric = float(metric(model(tokens).detach()))
    torch.testing.assert_close(got, torch.full((4,), clean_metric), atol=1e-5, rtol=0)  # clean patched into clean
    assert tl.get_act_patch_resid_pre(model, tokens, cache, metric).shape == (3, 4)  # the stream is everywhere


def test_bad_input_is_refused_in_one_line_and_leaves_no_hooks(llama):
    model, _, corrupted, cache = llama
    metric = logit_diff(3, 7)
    with pytest.raises(ValueError, match="pass exactly one of index_axis_names"):
        tl.generic_activation_patch(model, corrupted, cache, metric, tl.layer_pos_patch_setter, "resid_pre")
    with pytest.raises(ValueError, match="unknown index axis 'position'"):
        tl.generic_activation_patch(model, corrupted, cache, metric, tl.layer_pos_patch_setter, "resid_pre",
                                    index_axis_names=["layer", "position"])
    with pytest.raises(ValueError, match="layer_pos_patch_setter takes an index of 2 numbers"):
        tl.generic_activation_patch(model, corrupted, cache, metric, tl.layer_pos_patch_setter, "resid_pre",
                                    index_axis_names=["layer", "pos", "head"])
    with pytest.raises(ValueError, match=r"patching_metric must return a scalar, got shape \(2,\)"):
        tl.get_act_patch_mlp_out(model, corrupted, cache, lambda logits: logits[:, -1, 0])
    with pytest.raises(ValueError, match="clean and corrupted inputs must have the same shape"):
        tl.get_act_patch_attn_out(model, corrupted[:1], cache, metric)
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())

"""Activation patching: identities, and single patches checked against plain torch hooks on transformers."""

from __future__ import annotations

import pytest
import torch
from families import every_family, held_beside_the_stream
from golden import rounding

from lenskit.intervene.patching import activation_patching, logit_diff, next_token_loss, patching_hooks

ATOL = 1e-5


@pytest.fixture
def pair():
    """Clean and corrupted prompts that differ at one position only (position 4)."""
    clean = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    corrupted = clean.clone()
    corrupted[:, 4] = (clean[:, 4] + 37) % 101
    return clean, corrupted


@every_family
def test_patching_every_position_of_the_first_stream_recovers_clean_logits(model, pair):
    clean, corrupted = pair
    _, cache = model.run_with_cache(clean)
    clean_logits = model(clean)  # a plain run: caching every hook point takes the unfused kernels
    hooks = patching_hooks(model, cache, "resid_pre", 0)
    if getattr(model.cfg.block, "d_per_layer", None) is None:
        assert torch.equal(model.run_with_hooks(corrupted, fwd_hooks=hooks), clean_logits)
    else:
        beside = held_beside_the_stream(model, clean)  # Gemma 4 E2B/E4B's blocks read the tokens beside the stream
        assert not torch.allclose(model.run_with_hooks(corrupted, fwd_hooks=hooks), clean_logits, atol=1e-3)
        torch.testing.assert_close(model.run_with_hooks(corrupted, fwd_hooks=hooks + beside), clean_logits,
                                   atol=1e-5, rtol=0)
    assert not torch.allclose(model(corrupted), clean_logits)


@every_family
def test_patching_nothing_leaves_corrupted_logits_unchanged(model, pair):
    clean, corrupted = pair
    _, cache = model.run_with_cache(clean)
    corrupted_logits = model(corrupted)
    for site, kw in [("resid_mid", {"positions": []}), ("head", {"heads": []}), ("mlp_out", {"positions": []})]:
        hooks = patching_hooks(model, cache, site, 1, **kw)
        assert torch.equal(model.run_with_hooks(corrupted, fwd_hooks=hooks), corrupted_logits)


def test_loss_metric_matches_transformers(model, hf_model, pair):
    clean, _ = pair
    with torch.no_grad():
        expected = hf_model(clean, labels=clean).loss
        torch.testing.assert_close(next_token_loss(clean)(model(clean)), expected, atol=1e-5, rtol=0)


@every_family
def test_sweep_identities(model, pair):
    clean, corrupted = pair
    metric = logit_diff(3, 50)
    df = activation_patching(model, clean, corrupted, metric, sites=["resid_pre", "resid_post", "attn_out"],
                             per_position=True, progress=False)
    assert len(df) == 3 * model.cfg.n_layers * clean.shape[1]
    assert list(df.columns) == ["site", "layer", "position", "head", "metric", "normalized"]
    assert df["head"].isna().all()
    with torch.no_grad():
        assert df.attrs["clean_metric"] == pytest.approx(float(metric(model(clean))), abs=1e-6)
        assert df.attrs["corrupted_metric"] == pytest.approx(float(metric(model(corrupted))), abs=1e-6)
    resid = df[df.site == "resid_pre"].set_index(["layer", "position"])["normalized"]
    # Only position 4 differs: at block 0's input, patching it alone restores the clean run (where the stream carries
    # the whole input), the rest is a no-op.
    assert resid[(0, 4)] == 1.0 or getattr(model.cfg.block, "d_per_layer", None) is not None
    assert (resid.drop((0, 4)).loc[0] == 0.0).all()
    # Positions before the corruption are untouched by it at every layer (causal attention): exactly, but for the
    # rounding of a batch whose rows differ (a MoE's experts see other rows, and some CPUs' kernels block by rows),
    # on both logits of the difference, in units of the clean-corrupted gap.
    gap = abs(df.attrs["clean_metric"] - df.attrs["corrupted_metric"])
    assert (df[df.position < 4]["normalized"].abs() <= 2 * rounding(model, clean) / gap).all()
    if getattr(model.cfg.block, "d_per_layer", None) is not None:
        return  # the whole stream does not carry Gemma 4's per-layer inputs
    # The whole stream after any block carries everything: patched at all positions, the clean run comes back.
    whole = activation_patching(model, clean, corrupted, metric, sites=["resid_pre", "resid_post"],
                                per_position=False, progress=False)
    assert whole["position"].isna().all()
    assert whole["normalized"].tolist() == pytest.approx([1.0] * len(whole), abs=1e-6)


def test_reverse_direction_swaps_roles(model, pair):
    clean, corrupted = pair
    df = activation_patching(model, clean, corrupted, "loss", sites="resid_mid", per_position=False,
                             direction="corrupted->clean", progress=False)
    loss = next_token_loss(clean)
    with torch.no_grad():
        assert df.attrs["clean_metric"] == pytest.approx(float(loss(model(clean))), abs=1e-6)
        assert df.attrs["corrupted_metric"] == pytest.approx(float(loss(model(corrupted))), abs=1e-6)
    assert df.attrs["clean_metric"] != pytest.approx(df.attrs["corrupted_metric"], abs=1e-3)
    # running clean with the whole corrupted stream patched in gives the corrupted run's loss
    assert df["metric"].tolist() == pytest.approx([df.attrs["corrupted_metric"]] * 3, abs=1e-5)
    assert df["normalized"].tolist() == pytest.approx([1.0] * 3, abs=1e-5)


def _hf_patched_metric(hf_model, clean, corrupted, metric, module, kind, edit):
    """Run hf on clean to record `module`'s input (pre) or output, then on corrupted with `edit` applied."""
    seen = {}
    def record_pre(m, args):
        seen["x"] = args[0].clone()
    def record_out(m, args, out):
        seen["x"] = (out[0] if isinstance(out, tuple) else out).clone()
    def patch_pre(m, args):
        x = args[0].clone()
        edit(x, seen["x"])
        return (x, *args[1:])  # keep the mask hf passes positionally
    def patch_out(m, args, out):
        x = (out[0] if isinstance(out, tuple) else out).clone()
        edit(x, seen["x"])
        return (x, *out[1:]) if isinstance(out, tuple) else x
    with torch.no_grad():
        h = module.register_forward_pre_hook(record_pre) if kind == "pre" else module.register_forward_hook(record_out)
        try:
            hf_model(clean)
        finally:
            h.remove()
        h = module.register_forward_pre_hook(patch_pre) if kind == "pre" else module.register_forward_hook(patch_out)
        try:
            return float(metric(hf_model(corrupted).logits))
        finally:
            h.remove()


def test_single_patches_match_transformers(model, hf_model, pair):
    clean, corrupted = pair
    metric = logit_diff(7, 8)
    blocks, dh = hf_model.transformer.h, model.cfg.d_head
    df = activation_patching(model, clean, corrupted, metric, sites=["resid_pre", "attn_out", "head"], progress=False)
    got = df.set_index(["site", "layer", "position", "head"])["metric"]

    def at(p):
        def edit(x, src):
            x[:, p] = src[:, p]
        return edit
    for layer, pos in [(1, 4), (2, 6), (2, 3)]:
        expected = _hf_patched_metric(hf_model, clean, corrupted, metric, blocks[layer], "pre", at(pos))
        assert got[("resid_pre", layer, pos, pd_na())] == pytest.approx(expected, abs=ATOL)
        expected = _hf_patched_metric(hf_model, clean, corrupted, metric, blocks[layer].attn, "out", at(pos))
        assert got[("attn_out", layer, pos, pd_na())] == pytest.approx(expected, abs=ATOL)

    def head_at(head, p):
        def edit(x, src):
            x[:, p, head * dh:(head + 1) * dh] = src[:, p, head * dh:(head + 1) * dh]
        return edit
    for layer, head, pos in [(1, 2, 4), (2, 0, 8)]:
        expected = _hf_patched_metric(hf_model, clean, corrupted, metric, blocks[layer].attn.c_proj, "pre", head_at(head, pos))
        assert got[("head", layer, pos, head)] == pytest.approx(expected, abs=ATOL)


def pd_na():
    import pandas as pd
    return pd.NA


def test_errors(model, pair):
    clean, corrupted = pair
    _, cache = model.run_with_cache(clean)
    with pytest.raises(ValueError, match="same length"):
        activation_patching(model, clean, corrupted[:, :5], "loss", progress=False)
    with pytest.raises(ValueError, match="unknown patching site 'z'"):
        activation_patching(model, clean, corrupted, "loss", sites=["z"], progress=False)
    with pytest.raises(ValueError, match="direction"):
        activation_patching(model, clean, corrupted, "loss", direction="both", progress=False)
    with pytest.raises(IndexError, match="layer 3 is out of range"):
        patching_hooks(model, cache, "resid_pre", 3)
    with pytest.raises(IndexError, match="head 4 is out of range"):
        patching_hooks(model, cache, "head", 0, heads=[4])
    with pytest.raises(ValueError, match="same shape"):
        model.run_with_hooks(corrupted[:1], fwd_hooks=patching_hooks(model, cache, "resid_pre", 0))
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())

"""The logit lens against transformers' own ln_f and lm_head, at every stream and every sublayer write."""

import pytest
import torch
from families import every_family
from fixtures import random_tokens

from lenses import POINTS, LogitLens
from lenskit import Stream
from lenskit.observe.resid import late_writes
from lenskit.observe.stream import stream_hook_names, streams


@pytest.fixture(scope="module")
def hf_reference(hf_model, tokens):
    """transformers' hidden states plus each block's attention and MLP outputs, captured with torch hooks."""
    writes = {}
    handles = []
    for i, block in enumerate(hf_model.transformer.h):
        handles.append(block.attn.register_forward_hook(lambda m, a, out, i=i: writes.__setitem__(("attn_out", i), out[0])))
        handles.append(block.mlp.register_forward_hook(lambda m, a, out, i=i: writes.__setitem__(("mlp_out", i), out)))
    try:
        with torch.no_grad():
            out = hf_model(tokens, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return out, writes


def hf_decode(hf_model, h):
    with torch.no_grad():
        return hf_model.lm_head(hf_model.transformer.ln_f(h))


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, 13, seed=3)


@every_family
def test_last_stream_reproduces_model_logits(model, tokens):
    lens = LogitLens(model)
    logits, cache = model.run_with_cache(tokens)
    n = model.cfg.n_layers
    last = cache["resid_pre", n - 1] + cache["attn_out", n - 1] + cache["mlp_out", n - 1]
    for w in late_writes(model.hook_dict, n - 1):  # Gemma 4's per-layer input's write and rescaling, in order
        last = last + cache[f"blocks.{n - 1}.hook_{w}"]
    torch.testing.assert_close(lens(last, n), logits)
    # (the cached run takes LayerNorm's hooked, unfused path, hence float rounding rather than bit equality)
    torch.testing.assert_close(lens.decode(cache, n), logits, rtol=1e-5, atol=1e-6)


def test_every_stream_equals_transformers_ln_f_and_lm_head(model, hf_model, tokens, hf_reference):
    lens = LogitLens(model)
    hf_out, _ = hf_reference
    _, cache = model.run_with_cache(tokens)
    n = model.cfg.n_layers
    seen = 0
    with torch.no_grad():
        for s in streams(n):
            l, h = s.layer, cache.stream(s)
            if l < n:  # transformers' last hidden state already has ln_f applied; the others are raw streams
                torch.testing.assert_close(h, hf_out.hidden_states[l], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lens(h, l), hf_decode(hf_model, h), atol=1e-5, rtol=1e-5)
            seen += 1
    assert seen == n + 1
    torch.testing.assert_close(lens.decode(cache, n), hf_out.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("point", ["attn_out", "resid_mid", "mlp_out", "resid_post"])
def test_sublayer_points_equal_transformers(model, hf_model, tokens, hf_reference, point):
    lens = LogitLens(model)
    hf_out, writes = hf_reference
    _, cache = model.run_with_cache(tokens)
    for i in range(model.cfg.n_layers):
        if point in ("attn_out", "mlp_out"):
            ref_h = writes[point, i]
        elif point == "resid_mid":
            ref_h = hf_out.hidden_states[i] + writes["attn_out", i]
        else:
            ref_h = hf_out.hidden_states[i] + writes["attn_out", i] + writes["mlp_out", i]
        with torch.no_grad():
            got = lens.decode(cache, i, point=point)
        torch.testing.assert_close(got, hf_decode(hf_model, ref_h), atol=1e-4, rtol=1e-4)


def test_final_norm_is_recomputed_on_each_stream(model, tokens):
    """LayerNorm is scale-invariant, so a lens that recomputes its scale ignores a rescaled stream;
    one that reused a cached scale (TransformerLens' bug) would not."""
    lens = LogitLens(model)
    _, cache = model.run_with_cache(tokens)
    h = cache["resid_pre", 1]
    with torch.no_grad():
        torch.testing.assert_close(lens(h * 10, 1), lens(h * 100, 1), atol=1e-4, rtol=1e-4)
        # and reading stream 1 with the final stream's cached scale gives something else
        x = h - h.mean(-1, keepdim=True)
        final = cache["resid_post", model.cfg.n_layers - 1]
        final_scale = ((final - final.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + model.cfg.norm_eps).sqrt()
        stale = model.unembed(x / final_scale * model.ln_final.weight + model.ln_final.bias)
        assert (stale - lens(h, 1)).abs().max() > 1e-2


def test_points_and_errors(model, tokens):
    n = model.cfg.n_layers
    assert len(stream_hook_names(n, "resid_pre")) == n + 1 and len(stream_hook_names(n, "mlp_out")) == n
    assert Stream(n, "resid_pre").hook_name(n) == f"blocks.{n - 1}.hook_resid_post"
    assert set(POINTS) == {"resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"}
    lens = LogitLens(model)
    _, cache = model.run_with_cache(tokens)
    with pytest.raises(KeyError, match="unknown residual point"):
        lens.decode(cache, 0, point="resid_final")
    with pytest.raises(IndexError, match=r"0\.\.2"):
        lens.decode(cache, n, point="mlp_out")
    with pytest.raises(IndexError, match="out of range"):
        lens(cache["resid_pre", 0], n + 1)
    with pytest.raises(ValueError, match="d_model"):
        lens(torch.zeros(2, 5), 0)
    assert list(lens.parameters()) == []  # the model is not part of the lens's module tree

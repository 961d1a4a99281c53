"""Residual-stream anatomy: decompositions as identities, attribution against transformers' own tensors."""

from __future__ import annotations

import pytest
import torch

import lenskit
from lenses.anatomy import POINTS, decompose_resid, direct_logit_attribution, resid_norms
from lenskit import Stream


@pytest.fixture
def full(model, tokens):
    """Logits and a cache holding every hook point, the per-head writes included."""
    return model.run_with_cache(tokens, names_filter=lambda name: True)


def test_parts_sum_to_the_stream_at_every_point(model, full):
    _, cache = full
    n = model.cfg.n_layers
    for point in POINTS:
        for layer in range(n + 1 if point == "resid_pre" else n):
            for per_head in (False, True):
                parts = decompose_resid(cache, layer, point, per_head=per_head)
                assert parts.components.shape[1:] == cache.stream(Stream(layer, point)).shape
                torch.testing.assert_close(parts.total(), cache.stream(Stream(layer, point)), atol=1e-5, rtol=0)


def test_parts_follow_the_cache_identities(model, full, tokens):
    _, cache = full
    for layer in range(model.cfg.n_layers):
        pre, mid, post = (decompose_resid(cache, layer, p) for p in POINTS)
        # resid_mid = resid_pre + attn_out; resid_post = resid_mid + mlp_out; resid_post[l] = resid_pre[l+1]
        assert mid.labels == pre.labels + [f"{layer}_attn_out"] and post.labels == mid.labels + [f"{layer}_mlp_out"]
        assert torch.equal(mid.components[-1], cache["attn_out", layer])
        assert torch.equal(post.components[-1], cache["mlp_out", layer])
        assert torch.equal(post.components, decompose_resid(cache, layer + 1).components)
    first = decompose_resid(cache, 0)
    assert first.labels == ["embed", "pos_embed"]
    torch.testing.assert_close(first.components[0], model.embed.weight[tokens], atol=0, rtol=0)
    torch.testing.assert_close(first.components[1], model.pos_embed.weight[:17].expand(3, -1, -1), atol=0, rtol=0)


def test_per_head_parts_are_the_heads_and_the_output_bias(model, full):
    _, cache = full
    parts = decompose_resid(cache, model.cfg.n_layers, per_head=True)
    for layer in range(model.cfg.n_layers):
        bias = parts.components[parts.labels.index(f"{layer}_attn_bias")]
        # the bias part is attn_out - sum(heads); it must be the model's own out-projection bias
        torch.testing.assert_close(bias, model.blocks[layer].attn.out.bias.expand_as(bias), atol=1e-6, rtol=0)
        heads = [i for i, (k, l) in enumerate(zip(parts.kinds, parts.layers)) if k == "head" and l == layer]
        assert [parts.heads[i] for i in heads] == list(range(model.cfg.n_heads))


def hf_pieces(hf_model, tokens):
    """From transformers itself: the stream entering ln_f, the token embedding, and the last MLP's output."""
    seen = {}
    tr = hf_model.transformer
    handles = [
        tr.ln_f.register_forward_pre_hook(lambda m, args: seen.__setitem__("final", args[0])),
        tr.h[-1].mlp.register_forward_hook(lambda m, args, out: seen.__setitem__("mlp", out)),
    ]
    try:
        with torch.no_grad():
            logits = hf_model(tokens).logits
    finally:
        for h in handles:
            h.remove()
    return logits, seen["final"], tr.wte(tokens), seen["mlp"]


@pytest.mark.parametrize("minus", [None, 7])
def test_attribution_sums_to_the_logit_and_matches_transformers(hf_model, model, full, tokens, minus):
    _, cache = full
    for per_head in (False, True):
        dla = direct_logit_attribution(model, cache, 5, minus=minus, per_head=per_head)
        hf_logits, final, embed, mlp = hf_pieces(hf_model, tokens)
        want = hf_logits[:, -1, 5] - (0 if minus is None else hf_logits[:, -1, minus])
        got = torch.tensor(dla.groupby("batch").attribution.sum().to_numpy())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # exact identity for the linearised norm
        torch.testing.assert_close(torch.tensor(dla.attrs["logit"]), want, atol=1e-5, rtol=1e-5)

    # one row by hand, from transformers' tensors: centre(c) / s * w . (W_U[5] - W_U[7])
    ln_f, w_u = hf_model.transformer.ln_f, hf_model.lm_head.weight
    u = w_u[5] - (0 if minus is None else w_u[minus])
    x = final[:, -1]
    s = (x.var(-1, unbiased=False) + ln_f.eps).sqrt()
    for label, part in (("embed", embed[:, -1]), (f"{model.cfg.n_layers - 1}_mlp_out", mlp[:, -1])):
        by_hand = ((part - part.mean(-1, keepdim=True)) / s[:, None] * ln_f.weight) @ u
        rows = dla[dla.component == label].sort_values("batch")
        torch.testing.assert_close(torch.tensor(rows.attribution.to_numpy()), by_hand.detach(), atol=1e-5, rtol=1e-4)
    bias_rows = dla[dla.component == "ln_final.bias"].attribution.to_numpy()
    torch.testing.assert_close(torch.tensor(bias_rows), (ln_f.bias @ u).detach().expand(3), atol=1e-6, rtol=1e-5)


def test_attribution_with_rmsnorm_and_per_sequence_positions(tokens):
    torch.manual_seed(0)
    cfg = lenskit.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=101, n_ctx=64, norm="rmsnorm")
    model = lenskit.HookedTransformer(cfg).eval()
    with torch.no_grad():
        model.ln_final.weight.add_(torch.randn(32) * 0.3)
    logits, cache = model.run_with_cache(tokens)
    pos, target = torch.tensor([3, 16, 9]), torch.tensor([1, 2, 3])
    dla = direct_logit_attribution(model, cache, target, pos=pos)
    assert "ln_final.bias" not in set(dla.component) and list(dla.drop_duplicates("batch").position) == [3, 16, 9]
    want = logits[torch.arange(3), pos, target]
    torch.testing.assert_close(torch.tensor(dla.groupby("batch").attribution.sum().to_numpy()), want.detach(),
                               atol=1e-5, rtol=1e-5)


def test_norms_by_layer(model, full):
    _, cache = full
    norms = resid_norms(cache)
    n, d = model.cfg.n_layers, model.cfg.d_model
    assert len(norms) == ((n + 1) + 2 * n) * 3  # per sequence
    stream0 = cache["hook_embed"] + cache["hook_pos_embed"]  # [batch, pos, d_model]
    rows = norms[(norms.component == "resid") & (norms.layer == 0)].sort_values("batch")
    assert rows.mean_norm.to_numpy() == pytest.approx(stream0.norm(dim=-1).mean(-1).numpy(), rel=1e-5)
    assert rows.rms.to_numpy() == pytest.approx(stream0.pow(2).mean((1, 2)).sqrt().numpy(), rel=1e-5)
    last = norms[(norms.component == "mlp_out") & (norms.layer == n - 1) & (norms.batch == 2)].iloc[0]
    assert last.mean_norm == pytest.approx(cache["mlp_out", n - 1][2].norm(dim=-1).mean().item(), rel=1e-5)
    skip = resid_norms(cache, positions=slice(1, None))
    first_dropped = cache["resid_pre", 1][:, 1:].norm(dim=-1).mean(-1)
    got = skip[(skip.component == "resid") & (skip.layer == 1)].sort_values("batch").mean_norm.to_numpy()
    assert got == pytest.approx(first_dropped.numpy(), rel=1e-5)
    # per-position frame of a decomposition: rms = norm / sqrt(d_model)
    frame = decompose_resid(cache, n).to_frame()
    assert len(frame) == (2 + 2 * n) * 3 * 17
    assert frame.rms.to_numpy() == pytest.approx(frame.norm.to_numpy() / d**0.5)


def test_clear_errors(model, tokens, full):
    _, plain = model.run_with_cache(tokens)  # no hook_result without asking
    with pytest.raises(KeyError, match="names_filter=lambda name: True"):
        decompose_resid(plain, 1, per_head=True)
    with pytest.raises(IndexError, match=r"expected 0\.\.2"):
        decompose_resid(plain, 3, "resid_post")
    with pytest.raises(ValueError, match="point must be one of"):
        decompose_resid(plain, 1, "resid_middle")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        direct_logit_attribution(model, plain, 101)
    with pytest.raises(ValueError, match="one per sequence"):
        direct_logit_attribution(model, plain, torch.tensor([1, 2]))
    with pytest.raises(IndexError, match="out of range"):
        direct_logit_attribution(model, plain, 1, pos=17)


def test_plots_draw_the_frames(model, full):
    from lenses import plots

    _, cache = full
    dla = direct_logit_attribution(model, cache, 5, per_head=True)
    bars = plots.attribution_bars(dla, batch=1)
    rows = dla[dla.batch == 1]
    assert list(bars.data[0].y) == list(rows.component) and list(bars.data[0].x) == pytest.approx(list(rows.attribution))
    grid = plots.head_attribution_heatmap(dla)
    heads = dla[(dla.batch == 0) & (dla.kind == "head")]
    assert grid.data[0].z[1][2] == pytest.approx(heads[(heads.layer == 1) & (heads["head"] == 2)].attribution.item())
    with pytest.raises(ValueError, match="per_head=True"):
        plots.head_attribution_heatmap(direct_logit_attribution(model, cache, 5))
    curves = plots.resid_norm_curves(resid_norms(cache), log_y=True)
    names = {t.name for t in curves.data if t.showlegend is not False}
    assert names == {"resid", "attn_out", "mlp_out"}
    mlp = next(t for t in curves.data if t.name == "mlp_out")
    assert list(mlp.x) == [0.5, 1.5, 2.5]  # a write sits between the streams it reads and feeds

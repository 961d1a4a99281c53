"""Activation patching of the head sites q, k, v and pattern: each patch against a hand-written hook on every family,
q/k/v against transformers' own projections, grouped-query attention's kv heads, the refusal on linear-attention
blocks, the sweep, and attribution patching's estimate of the new sites."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_gpt2
from families import every_family, family_model_of

import lenskit
from lenskit.intervene.attribution import attribution_patching
from lenskit.intervene.patching import activation_patching, logit_diff, patching_hooks

CORRUPT = 2  # the one position where clean and corrupted differ
HEAD_SITES = ("head", "q", "k", "v", "pattern")


def make_pair(vocab: int, n_pos: int = 7, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.randint(0, vocab, (2, n_pos), generator=torch.Generator().manual_seed(seed))
    corrupted = clean.clone()
    corrupted[:, CORRUPT] = (clean[:, CORRUPT] + 37) % vocab
    return clean, corrupted


def full_layers(model) -> list[int]:
    return [l for l in range(model.cfg.n_layers) if model.cfg.has_heads(l)]


def hand_hook(value: torch.Tensor, where: tuple):
    """The reference: copy value[where] into a clone of the activation."""
    def hook(x, hook):
        x = x.clone()
        x[where] = value[where]
        return x
    return hook


def run(model, tokens, hooks) -> torch.Tensor:
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)


@every_family
def test_each_head_site_patches_what_a_hand_written_hook_patches(model):
    clean, corrupted = make_pair(model.cfg.d_vocab)
    _, cache = model.run_with_cache(clean)
    corrupted_logits = run(model, corrupted, [])
    layers = full_layers(model)
    for layer in {layers[0], layers[-1]}:
        n_kv = model.cfg.n_kv_heads_of(layer)
        cases = [  # (site, hook, patching_hooks kwargs, index of the hand hook)
            ("head", "z", dict(positions=CORRUPT, heads=1), (slice(None), CORRUPT, 1)),
            ("q", "q", dict(positions=[CORRUPT], heads=[model.cfg.n_heads - 1]), (slice(None), CORRUPT, model.cfg.n_heads - 1)),
            ("k", "k", dict(positions=CORRUPT, heads=n_kv - 1), (slice(None), CORRUPT, n_kv - 1)),
            ("v", "v", dict(heads=0), (slice(None), slice(None), 0)),
            ("pattern", "pattern", dict(positions=5, heads=2), (slice(None), 2, 5)),
            ("pattern", "pattern", dict(positions=[5, 6], heads=[0, 3], sources=[CORRUPT]),
             (slice(None), [[0], [3]], [[5, 6]], CORRUPT)),
        ]
        for site, short, kw, where in cases:
            name = f"blocks.{layer}.attn.hook_{short}"
            got = run(model, corrupted, patching_hooks(model, cache, site, layer, **kw))
            want = run(model, corrupted, [(name, hand_hook(cache[name], where))])
            assert torch.equal(got, want), (site, layer, kw)
            assert not torch.equal(got, corrupted_logits), (site, layer, kw)  # the patch did something


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_q_k_v_patches_match_transformers_projections(family):
    """hook_q/k/v are the projections' outputs, head by head: patch the same slice of transformers' projection."""
    pair = family_model_of(family)
    model, hf = pair.model, pair.hf
    clean, corrupted = make_pair(model.cfg.d_vocab)
    metric = logit_diff(5, 9)
    _, cache = model.run_with_cache(clean)
    dh, d_q, d_kv = model.cfg.d_head, model.cfg.n_heads * model.cfg.d_head, model.cfg.n_kv_heads * model.cfg.d_head
    layer = 1
    if family == "gpt2":
        proj = {s: hf.transformer.h[layer].attn.c_attn for s in "qkv"}  # one fused output: [q | k | v]
        offset = {"q": 0, "k": d_q, "v": d_q + d_kv}
    else:
        attn = hf.model.layers[layer].self_attn
        proj = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj}
        offset = {"q": 0, "k": 0, "v": 0}
    for site, head, pos in [("q", 3, CORRUPT), ("k", model.cfg.n_kv_heads - 1, CORRUPT), ("v", 0, 5), ("k", 0, 6)]:
        cols = slice(offset[site] + head * dh, offset[site] + (head + 1) * dh)
        seen = {}
        with torch.no_grad():
            h = proj[site].register_forward_hook(lambda m, a, out: seen.update(x=out.clone()))
            try:
                hf(clean)
            finally:
                h.remove()

            def patch(m, a, out):
                out = out.clone()
                out[:, pos, cols] = seen["x"][:, pos, cols]
                return out
            h = proj[site].register_forward_hook(patch)
            try:
                want = float(metric(hf(corrupted).logits))
            finally:
                h.remove()
        got = float(metric(run(model, corrupted, patching_hooks(model, cache, site, layer, positions=pos, heads=head))))
        assert got == pytest.approx(want, abs=1e-5), (family, site, head, pos)


def test_a_kv_head_patch_reaches_exactly_its_group_of_query_heads():
    model = family_model_of("llama").model
    group = model.cfg.n_heads // model.cfg.n_kv_heads
    assert group > 1, "the tiny llama should have grouped-query attention"
    clean, corrupted = make_pair(model.cfg.d_vocab)
    _, cache = model.run_with_cache(clean)
    layer = 0
    names = [f"blocks.{layer}.attn.hook_attn_scores", f"blocks.{layer}.attn.hook_z"]
    _, base = model.run_with_cache(corrupted, names_filter=names)
    for site, seen_at in [("k", names[0]), ("v", names[1])]:
        for kv_head in range(model.cfg.n_kv_heads):
            with model.hooks(patching_hooks(model, cache, site, layer, heads=kv_head)):
                _, patched = model.run_with_cache(corrupted, names_filter=names)
            head_axis = 1 if site == "k" else 2  # scores [batch, head, q, k]; z [batch, pos, head, d_head]
            moved = (patched[seen_at] != base[seen_at]).transpose(0, head_axis).flatten(1).any(1)
            assert moved.tolist() == [h // group == kv_head for h in range(model.cfg.n_heads)], (site, kv_head)


def test_head_sites_are_refused_on_linear_attention_blocks_and_work_on_full_ones():
    model = family_model_of("qwen3_5_text").model
    clean, corrupted = make_pair(model.cfg.d_vocab)
    _, cache = model.run_with_cache(clean)
    linear = [l for l in range(model.cfg.n_layers) if not model.cfg.has_heads(l)]
    for site in HEAD_SITES:
        for layer in linear:
            with pytest.raises(ValueError, match=rf"site '{site}': block {layer} is a linear-attention \(Gated DeltaNet\) "
                                                 r"layer, which has no attention heads; patch its 'attn_out'"):
                patching_hooks(model, cache, site, layer, heads=0)
    layer = full_layers(model)[0]
    name = f"blocks.{layer}.attn.hook_pattern"
    got = run(model, corrupted, patching_hooks(model, cache, "pattern", layer, heads=1, positions=4))
    assert torch.equal(got, run(model, corrupted, [(name, hand_hook(cache[name], (slice(None), 1, 4)))]))
    df = activation_patching(model, clean, corrupted, logit_diff(1, 2), sites=list(HEAD_SITES), per_position=False,
                             progress=False)
    assert set(df["layer"]) == set(full_layers(model))
    for site in HEAD_SITES:
        n = model.cfg.n_kv_heads if site in ("k", "v") else model.cfg.n_heads
        assert len(df[df.site == site]) == len(full_layers(model)) * n, site


def test_the_sweep_runs_each_head_site_patch_as_patching_hooks_does():
    model = family_model_of("llama").model
    clean, corrupted = make_pair(model.cfg.d_vocab)
    metric = logit_diff(4, 11)
    df = activation_patching(model, clean, corrupted, metric, sites=["q", "k", "v", "pattern"], progress=False)
    for site in ("q", "k", "v", "pattern"):
        rows = df[df.site == site]
        n = model.cfg.n_kv_heads if site in ("k", "v") else model.cfg.n_heads
        assert len(rows) == model.cfg.n_layers * n * clean.shape[1]
        # Causal attention: nothing before the corrupted position moves, whichever head site is patched there (up to
        # the eager attention a hooked head takes, where the unhooked run takes the fused kernel).
        assert rows[rows.position < CORRUPT]["normalized"].abs().max() < 1e-4
        assert rows[rows.position >= CORRUPT]["normalized"].abs().max() > 1e-2
    _, cache = model.run_with_cache(clean)
    got = df.set_index(["site", "layer", "position", "head"])["metric"]
    for site, layer, pos, head in [("q", 1, 4, 2), ("k", 2, CORRUPT, 1), ("v", 0, CORRUPT, 0), ("pattern", 2, 6, 3)]:
        want = float(metric(run(model, corrupted, patching_hooks(model, cache, site, layer, positions=pos, heads=head))))
        assert got[(site, layer, pos, head)] == pytest.approx(want, abs=1e-6)  # the sweep records fewer hooks


def test_bad_head_site_arguments_say_what_to_do(model):
    clean, _ = make_pair(model.cfg.d_vocab)
    _, cache = model.run_with_cache(clean)
    with pytest.raises(ValueError, match="sources= .* applies to the 'pattern' site only, not 'q'"):
        patching_hooks(model, cache, "q", 0, sources=[1])
    with pytest.raises(ValueError, match="heads= applies to the head sites"):
        patching_hooks(model, cache, "resid_pre", 0, heads=[1])
    with pytest.raises(IndexError, match="head 4 is out of range; block 1 has 4 heads for site 'pattern'"):
        patching_hooks(model, cache, "pattern", 1, heads=[4])
    with pytest.raises(IndexError, match="patch source position 9 is out of range"):
        run(model, clean, patching_hooks(model, cache, "pattern", 1, sources=[9]))
    llama = family_model_of("llama").model
    _, llama_cache = llama.run_with_cache(clean)
    with pytest.raises(IndexError, match="block 0 has 2 key/value heads for site 'k'"):
        patching_hooks(llama, llama_cache, "k", 0, heads=[2])
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


@pytest.fixture(scope="module")
def gpt2_64() -> lenskit.HookedTransformer:
    return lenskit.HookedTransformer.from_hf(make_hf_gpt2().double())


@pytest.mark.parametrize("site", ["q", "k", "v", "pattern"])
def test_attribution_estimates_the_new_head_sites_by_their_directional_derivative(gpt2_64, site):
    model = gpt2_64
    clean, corrupted = make_pair(101, n_pos=6)

    def metric(logits):  # every logit counts: q's effect through near-uniform patterns is small
        return logits[:, -1].pow(2).sum(-1).mean()
    df = attribution_patching(model, clean, corrupted, metric, sites=site)
    assert len(df) == model.cfg.n_layers * model.cfg.n_heads * 6
    _, cache = model.run_with_cache(clean)
    eps, slopes = 1e-5, []
    for layer, pos, head in [(0, CORRUPT, 1), (1, 4, 3), (2, 5, 0)]:
        name = f"blocks.{layer}.attn.hook_{site}"
        where = (slice(None), head, pos) if site == "pattern" else (slice(None), pos, head)

        def along(step):
            def nudge(x, hook):
                x = x.clone()
                x[where] += step * (cache[name][where] - x[where])
                return x
            with torch.no_grad():
                return float(metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, nudge)])))
        slopes.append((along(eps) - along(-eps)) / (2 * eps))
        row = df[(df.layer == layer) & (df.position == pos) & (df["head"] == head)]
        assert float(row["attribution"].iloc[0]) == pytest.approx(slopes[-1], rel=1e-5, abs=1e-9)
    assert max(map(abs, slopes)) > 2e-7  # well above the tolerance: the comparison is not 0 = 0


def test_the_heatmap_draws_a_head_site_as_layer_head_rows():
    from lenses.plots import patching_heatmap

    model = family_model_of("llama").model
    clean, corrupted = make_pair(model.cfg.d_vocab, n_pos=4)
    df = activation_patching(model, clean, corrupted, logit_diff(4, 11), sites="k", progress=False)
    z = patching_heatmap(df).data[0].z
    assert len(z) == model.cfg.n_layers * model.cfg.n_kv_heads and len(z[0]) == 4  # layer.kv_head by position
    whole = activation_patching(model, clean, corrupted, logit_diff(4, 11), sites="pattern", per_position=False,
                                progress=False)
    z = patching_heatmap(whole).data[0].z
    assert len(z) == model.cfg.n_layers and len(z[0]) == model.cfg.n_heads  # layer by head

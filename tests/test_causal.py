"""Causal basis extraction against the tuned-lens package, mean ablation in the model's forward against a hand
projection, and causal fidelity against a direct computation with transformers' own modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_gpt2
from lens_fixtures import random_tuned

import lenskit
from lenses import LogitLens, metrics
from lenses.causal import (
    ablate_subspace,
    causal_fidelity,
    extract_causal_bases,
    influence_windows,
    lens_influence,
    mean_ablate,
    stream_hiddens,
)


def orthonormal(d, k, seed=0):
    return torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(seed)))[0]


def hand_ablate(h, V, mu):
    """Coordinates along V replaced by mu's, written out: h - sum_j <h - mu, v_j> v_j."""
    out = h.clone()
    for j in range(V.shape[1]):
        v = V[:, j]
        out = out - ((h - mu) * v).sum(-1, keepdim=True) * v
    return out


# ------------------------------------------------------------------ ablation
def test_mean_ablate_is_the_hand_projection_and_the_packages_remove_subspace():
    h = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(1))
    V, mu = orthonormal(16, 3), h.reshape(-1, 16).mean(0)
    got = mean_ablate(h, V, mu)
    torch.testing.assert_close(got, hand_ablate(h, V, mu))
    torch.testing.assert_close(got @ V, (mu @ V).expand(4, 7, 3))  # along V every token now sits at the mean
    torch.testing.assert_close(mean_ablate(got, V, mu), got)  # idempotent
    torch.testing.assert_close(mean_ablate(h, V), h - (h @ V) @ V.T)  # no mean: projected out
    pytest.importorskip("tuned_lens")
    from tuned_lens.causal import remove_subspace

    torch.testing.assert_close(got, remove_subspace(h, V, mode="mean", orthonormal=True), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layer", [0, 2, 3])  # the embeddings, a middle stream, the last block's output
def test_ablate_subspace_edits_the_stream_in_the_models_own_forward(model, tokens, layer):
    n = model.cfg.n_layers
    V, mu = orthonormal(model.cfg.d_model, 2, seed=layer), torch.randn(model.cfg.d_model)
    clean, cache = model.run_with_cache(tokens)
    x = hand_ablate(cache["resid_pre", layer] if layer < n else cache["resid_post", n - 1], V, mu)
    expected_stream = x
    for block in model.blocks[layer:]:  # the rest of the forward, by hand, from the ablated stream
        x = block(x)
    expected = model.readout(x)
    name = lenskit.Stream(layer).hook_name(n)
    seen = {}
    with ablate_subspace(model, layer, V, mu):
        logits, inside = model.run_with_cache(tokens, names_filter=[name])
        # composes with run_with_hooks: a hook added inside sees the ablated stream
        model.run_with_hooks(tokens, fwd_hooks=[(name, lambda t, hook: seen.setdefault("x", t.clone()))])
    torch.testing.assert_close(inside[name], expected_stream)
    torch.testing.assert_close(seen["x"], expected_stream)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert (logits - clean).abs().max() > 1e-3  # the ablation did change the output
    assert not model.hook_dict[name].has_hooks()
    torch.testing.assert_close(model(tokens), clean)  # gone: the model is clean again
    with pytest.raises(RuntimeError, match="inside"), ablate_subspace(model, layer, V, mu):
        raise RuntimeError("inside")
    assert not model.hook_dict[name].has_hooks()  # removed on the way out of a raise too


# ------------------------------------------------------------------ causal basis extraction
@pytest.fixture(scope="module")
def hiddens(model):
    tokens = torch.randint(0, model.cfg.d_vocab, (8, 16), generator=torch.Generator().manual_seed(0))
    return stream_hiddens(model, tokens, 1, batch=3), tokens


def test_bases_are_orthonormal_and_each_direction_is_a_maximum(model, hiddens):
    h, _ = hiddens
    lens = random_tuned(model)
    before = {k: v.clone() for k, v in lens.state_dict().items()}
    basis = extract_causal_bases(lens, h, 4, stream=1)
    V = basis.vectors
    assert V.shape == (model.cfg.d_model, 4) and basis.energies.shape == (4,)
    torch.testing.assert_close(V.T @ V, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(basis.energies, lens_influence(lens, h, 1, V).reshape(4, -1).mean(-1).float(), rtol=1e-4, atol=0)
    torch.testing.assert_close(basis.mean, h.reshape(-1, h.shape[-1]).mean(0))
    # No random unit direction beats the first; none orthogonal to it beats the second.
    trial = torch.nn.functional.normalize(torch.randn(model.cfg.d_model, 32, generator=torch.Generator().manual_seed(2)), dim=0)
    assert lens_influence(lens, h, 1, trial).reshape(32, -1).mean(-1).max() < basis.energies[0]
    off = torch.nn.functional.normalize(trial - V[:, :1] @ (V[:, :1].T @ trial), dim=0)
    assert lens_influence(lens, h, 1, off).reshape(32, -1).mean(-1).max() < basis.energies[1]
    assert all(torch.equal(v, lens.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in [*lens.parameters(), *model.parameters()])  # nothing accumulated in weights
    with pytest.raises(ValueError, match="k=0: expected a whole number of directions from 1 to d_model=32"):
        extract_causal_bases(lens, h, 0, stream=1)


@pytest.fixture(scope="module")
def package():
    pytest.importorskip("tuned_lens")
    from benchmarks.tuned_lens_package import import_package

    import_package()  # its stand-ins: the package reaches for TransformerLens 3 otherwise
    from tuned_lens import causal, nn

    return causal, nn


def package_bases(causal, pkg_lens, cache, n_layers, layer, k):
    """The package's `extract_causal_bases` (it walks every layer in turn); its basis at `layer`."""
    hs = [cache["resid_pre", l] for l in range(n_layers)] + [cache["resid_post", n_layers - 1]]
    for l, basis in enumerate(causal.extract_causal_bases(pkg_lens, hs, k)):
        if l == layer:
            return basis


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_bases_match_the_packages_on_a_tuned_lens(package, layer):
    """The same tuned lens (our translators in the package's TunedLens), hiddens, k and start. The package
    starts from the SVD of its `transform_hidden` applied to the unembedding along the vocabulary axis, which
    only runs when d_vocab == d_model, hence this model's 32-token vocabulary; ours is handed the same start.
    Larger weights (initializer_range 0.2) give KLs of a tenth of a nat, so both optimisers converge: the
    energies and the directions must agree, whatever the order each found them in."""
    causal, nn = package
    hf = make_hf_gpt2(vocab_size=32, initializer_range=0.2)
    model = lenskit.HookedTransformer.from_hf(hf)
    ours = random_tuned(model)
    theirs = nn.TunedLens.from_model(hf)
    theirs.layer_translators.load_state_dict({k.removeprefix("translators."): v for k, v in ours.state_dict().items()})
    tokens = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(tokens)
    ref = package_bases(causal, theirs, cache, model.cfg.n_layers, layer, k=4)
    start = torch.linalg.svd(theirs.transform_hidden(theirs.unembed.unembedding.weight.data.T, layer), full_matrices=False)[0]
    mine = extract_causal_bases(ours, cache["resid_pre", layer], 4, stream=layer, init=start.detach(), max_iter=100,
                                tol=1e-7)  # run to convergence, as the package does here
    h = cache["resid_pre", layer]
    # The objective is the package's: ours at its vectors gives its energies.
    torch.testing.assert_close(lens_influence(ours, h, layer, ref.vectors).reshape(4, -1).mean(-1).float(), ref.energies,
                               rtol=1e-4, atol=0)
    order = mine.energies.argsort(descending=True)  # the package sorts its basis by energy
    torch.testing.assert_close(mine.energies[order], ref.energies, rtol=1e-3, atol=0)
    cosines = (mine.vectors[:, order].T @ ref.vectors).abs().diagonal()
    assert cosines.min() > 0.999, cosines


def test_bases_match_or_beat_the_packages_on_the_logit_lens(package, model, hf_model):
    """The default-sized tiny model's KLs are 1e-5 to 1e-3 nats. Both start from the same SVD of the unembedding
    (our default start is the package's for the logit lens). At stream 0 both converge to the same basis; at
    later streams the package's L-BFGS stops on its absolute gradient tolerance (1e-7) near its start, while
    ours, scaled to a relative tolerance, climbs on: ours must reach at least the package's energy at every rank."""
    causal, nn = package
    lens, theirs = LogitLens(model), nn.LogitLens.from_model(hf_model)
    tokens = torch.randint(0, 101, (8, 16), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(tokens)
    for layer in range(model.cfg.n_layers):
        ref = package_bases(causal, theirs, cache, model.cfg.n_layers, layer, k=4)
        h = cache["resid_pre", layer]
        mine = extract_causal_bases(lens, h, 4, stream=layer)
        torch.testing.assert_close(lens_influence(lens, h, layer, ref.vectors).reshape(4, -1).mean(-1).float(),
                                   ref.energies, rtol=1e-4, atol=1e-7)  # float32 sums of KLs near 1e-5 nats
        ranked = mine.energies.sort(descending=True).values
        assert (ranked >= ref.energies * (1 - 1e-3)).all(), (layer, ranked, ref.energies)
        if layer == 0:
            torch.testing.assert_close(ranked, ref.energies, rtol=1e-3, atol=0)
            assert torch.linalg.svdvals(mine.vectors.T @ ref.vectors).min() > 0.999  # the same subspace


# ------------------------------------------------------------------ causal fidelity
def test_fidelity_numbers_match_a_direct_computation_with_transformers():
    """Lens influence by transformers' ln_f and lm_head on the hand-ablated stream; model influence by a forward
    hook on transformers' own block (stream 2 is block 1's output); Spearman's rho by scipy. Larger weights
    (initializer_range 0.2) give influences of 1e-3 to 1e-1 nats, well above float32's rounding."""
    hf_model = make_hf_gpt2(initializer_range=0.2)
    model = lenskit.HookedTransformer.from_hf(hf_model)
    tuned = random_tuned(model, seed=3, scale=0.2)
    windows = torch.randint(0, 101, (6, 12), generator=torch.Generator().manual_seed(4))
    table = causal_fidelity(model, tuned, windows, stream=2, k=4, batch=4)
    assert list(table.columns) == ["direction", "lens_influence", "model_influence"] and len(table) == 4
    assert table.attrs["n_windows"] == 6 and table.attrs["n_tokens"] == 72 and table.attrs["stream"] == str(lenskit.Stream(2))
    basis = extract_causal_bases(tuned, stream_hiddens(model, windows, 2), 4, stream=2)  # deterministic: the same
    out = hf_model(windows, output_hidden_states=True)
    h, final = out.hidden_states[2], out.logits.log_softmax(-1)
    t = tuned.translators[2]

    def lens_logp(x):
        return hf_model.lm_head(hf_model.transformer.ln_f(x + x @ t.weight.T + t.bias)).log_softmax(-1)

    for j in range(4):
        V = basis.vectors[:, j:j + 1]
        ablated = hand_ablate(h, V, basis.mean)
        lens_kl = F.kl_div(lens_logp(ablated), lens_logp(h), log_target=True, reduction="none").sum(-1).mean()
        handle = hf_model.transformer.h[1].register_forward_hook(
            lambda mod, args, output: hand_ablate(output, V, basis.mean) if torch.is_tensor(output)
            else (hand_ablate(output[0], V, basis.mean), *output[1:]))
        try:
            model_logp = hf_model(windows).logits.log_softmax(-1)
        finally:
            handle.remove()
        model_kl = F.kl_div(model_logp, final, log_target=True, reduction="none").sum(-1).mean()
        assert table.lens_influence[j] == pytest.approx(lens_kl.item(), rel=1e-4), j
        assert table.model_influence[j] == pytest.approx(model_kl.item(), rel=1e-4), j
        assert model_kl > 1e-6  # each direction moves the model
    stats = pytest.importorskip("scipy.stats")
    assert table.attrs["spearman"] == pytest.approx(stats.spearmanr(table.lens_influence, table.model_influence)[0])


def test_influence_rows_are_per_window_means_and_bootstrap_spearman_resamples_them(model):
    tuned = random_tuned(model, seed=5, scale=0.2)
    windows = torch.randint(0, 101, (6, 12), generator=torch.Generator().manual_seed(6))
    basis = extract_causal_bases(tuned, stream_hiddens(model, windows, 1), 5, stream=1)
    tidy = influence_windows(model, tuned, windows, basis, batch=4)
    assert len(tidy) == 5 * 6 and sorted(tidy.window.unique()) == list(range(6))
    per_token = lens_influence(tuned, stream_hiddens(model, windows, 1), 1, basis.vectors, basis.mean)  # [k, window, pos]
    torch.testing.assert_close(torch.tensor(tidy.sort_values(["direction", "window"]).lens_influence.to_numpy()),
                               per_token.mean(-1).reshape(-1).double(), rtol=1e-6, atol=0)
    ci = metrics.bootstrap_spearman(tidy, "lens_influence", "model_influence", over="direction", unit="window", n_boot=200)
    means = tidy.groupby("direction")[["lens_influence", "model_influence"]].mean()
    stats = pytest.importorskip("scipy.stats")
    assert ci["rho"] == pytest.approx(stats.spearmanr(means.lens_influence, means.model_influence)[0])
    assert ci["lo"] <= ci["rho"] + 1e-9 and ci["rho"] - 1e-9 <= ci["hi"] and (ci["n_groups"], ci["n_units"]) == (5, 6)
    assert metrics.bootstrap_spearman(tidy, "lens_influence", "model_influence", over="direction", n_boot=200) == ci


def test_spearman_with_ties_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    x = torch.tensor([[1.0, 2.0, 2.0, 5.0, 3.0], [0.5, 0.1, 0.9, 0.9, 0.9]])
    y = torch.tensor([[2.0, 1.0, 4.0, 4.0, 9.0], [3.0, 2.0, 1.0, 0.0, 5.0]])
    got = metrics.spearman(x, y)
    for row in range(2):
        assert got[row].item() == pytest.approx(stats.spearmanr(x[row], y[row])[0])
    assert torch.isnan(metrics.spearman(torch.ones(4), torch.arange(4.0)))


def test_fidelity_figures_draw_the_numbers_given():
    import pandas as pd

    from lenses import plots

    summary = pd.DataFrame({"lens": ["tuned"] * 3, "stream": [0, 1, 2], "rho": [0.5, 0.9, 0.7], "lo": [0.2, 0.8, 0.4],
                            "hi": [0.8, 1.0, 0.9]})
    fig = plots.fidelity_curves(summary)
    line = [t for t in fig.data if t.mode == "lines+markers"][0]
    assert list(line.x) == [0, 1, 2] and list(line.y) == [0.5, 0.9, 0.7] and tuple(fig.layout.yaxis.range) == (-1.05, 1.05)
    directions = pd.DataFrame({"stream": [0, 0, 3], "direction": [0, 1, 0], "lens_influence": [0.1, 0.02, 0.5],
                               "model_influence": [0.3, 0.01, 0.2]})
    scatter = plots.fidelity_scatter(directions)
    assert [t.name for t in scatter.data] == ["stream emb", "stream 3"] and list(scatter.data[0].x) == [0.1, 0.02]
    assert scatter.layout.xaxis.type == "log" and list(scatter.data[1].y) == [0.2]
    with pytest.raises(KeyError, match="needs columns"):
        plots.fidelity_scatter(directions.drop(columns="stream"))

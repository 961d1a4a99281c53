"""Attribution patching: each estimate is the derivative along (source - base), checked by finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_hf_gpt2
from families import every_family

import lenskit
from lenskit.intervene.attribution import activations_and_gradients, attribution_patching
from lenskit.intervene.masks import replace_where
from lenskit.intervene.patching import activation_patching, logit_diff, site_hook_name

SITES = ["resid_pre", "attn_out", "mlp_out", "resid_post", "head"]


@pytest.fixture(scope="module")
def gpt2_64() -> lenskit.HookedTransformer:
    """float64, so that a finite difference is exact to many digits."""
    return lenskit.HookedTransformer.from_hf(make_hf_gpt2().double())


@pytest.fixture
def pair():
    clean = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(5))
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 41) % 101
    corrupted[:, 5] = (clean[:, 5] + 17) % 101
    return clean, corrupted


def _along(model, run, source_cache, name, position, head, eps, metric) -> float:
    """metric with the activation at `name` (one position, one head or all) moved eps of the way to the source."""
    def nudge(x, hook):
        target = x + eps * (source_cache[name] - x)
        return replace_where(x, target, [position], axis=2, units=None if head is None else [head])

    with torch.no_grad():
        return float(metric(model.run_with_hooks(run, fwd_hooks=[(name, nudge)])))


@pytest.mark.parametrize("direction", ["clean->corrupted", "corrupted->clean"])
def test_every_estimate_is_the_directional_derivative(gpt2_64, pair, direction):
    model, metric = gpt2_64, logit_diff(3, 50)
    clean, corrupted = pair
    df = attribution_patching(model, clean, corrupted, metric, sites=SITES, direction=direction)
    source, run = (clean, corrupted) if direction == "clean->corrupted" else (corrupted, clean)
    with torch.no_grad():
        base = float(metric(model(run)))
        _, source_cache = model.run_with_cache(source)
    assert df.attrs["method"] == "attribution"
    np.testing.assert_allclose(df["metric"].to_numpy() - df["attribution"].to_numpy(), base, atol=1e-12, rtol=0)
    eps = 1e-5
    checked = 0
    for row in df.itertuples():
        head = int(row.head) if row.site == "head" else None
        if row.position not in (1, 2, 5, 7) or (head is not None and head not in (0, 3)):
            continue  # a sample of rows keeps the test fast; positions 2 and 5 differ, 1 and 7 only through attention
        name = site_hook_name(row.site, row.layer, model.cfg.n_layers)
        up = _along(model, run, source_cache, name, int(row.position), head, eps, metric)
        down = _along(model, run, source_cache, name, int(row.position), head, -eps, metric)
        derivative = (up - down) / (2 * eps)
        assert row.attribution == pytest.approx(derivative, rel=1e-5, abs=1e-9), row
        checked += 1
    assert checked > 40
    moved = df[df["position"].isin([2, 5]) & (df["site"] == "resid_pre")]
    assert (moved["attribution"].abs() > 1e-5).all()  # the differing positions do matter: the comparison is not 0 = 0
    assert (df[(df["site"] == "resid_pre") & (df["layer"] == 0) & ~df["position"].isin([2, 5])]["attribution"] == 0).all()


def test_per_position_false_is_the_sum_and_the_normalisation(gpt2_64, pair):
    clean, corrupted = pair
    metric = logit_diff(7, 11)
    by_pos = attribution_patching(gpt2_64, clean, corrupted, metric, sites=["attn_out", "head"])
    whole = attribution_patching(gpt2_64, clean, corrupted, metric, sites=["attn_out", "head"], per_position=False)
    assert whole["position"].isna().all()
    summed = by_pos.groupby(["site", "layer", "head"], dropna=False, sort=False)["attribution"].sum()
    np.testing.assert_allclose(whole["attribution"].to_numpy(), summed.to_numpy(), atol=1e-12, rtol=1e-9)
    span = by_pos.attrs["clean_metric"] - by_pos.attrs["corrupted_metric"]
    np.testing.assert_allclose(by_pos["normalized"].to_numpy(), by_pos["attribution"].to_numpy() / span, atol=1e-12, rtol=0)


def test_the_layout_is_activation_patchings(gpt2_64, pair):
    """The same rows in the same order, the same measured metrics, and no effect where the exact patch has none.
    (How close the estimate is to an exact patch of a small step is the finite-difference test above.)"""
    clean, corrupted = pair
    metric = logit_diff(3, 50)
    est = attribution_patching(gpt2_64, clean, corrupted, metric, sites=["resid_pre", "head"])
    exact = activation_patching(gpt2_64, clean, corrupted, metric, sites=["resid_pre", "head"], progress=False)
    assert list(est.columns) == [*exact.columns, "attribution"]
    assert est[["site", "layer", "position", "head"]].equals(exact[["site", "layer", "position", "head"]])
    assert est.attrs["clean_metric"] == pytest.approx(exact.attrs["clean_metric"], abs=1e-12)
    assert est.attrs["corrupted_metric"] == pytest.approx(exact.attrs["corrupted_metric"], abs=1e-12)
    # Unchanged positions of the first block's input: patching them changes nothing, and nor does the estimate.
    same = (est["site"] == "resid_pre") & (est["layer"] == 0) & ~est["position"].isin([2, 5])
    assert (exact.loc[same, "metric"] == exact.attrs["corrupted_metric"]).all() and (est.loc[same, "attribution"] == 0).all()


def test_frozen_parameters_and_no_grad_callers(pair):
    """It needs no parameter gradients, fills none, and works inside torch.no_grad()."""
    model = lenskit.HookedTransformer.from_hf(make_hf_gpt2())
    clean, corrupted = pair
    metric = logit_diff(3, 50)
    free = attribution_patching(model, clean, corrupted, metric, sites=["resid_mid"])
    assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        frozen = attribution_patching(model, clean, corrupted, metric, sites=["resid_mid"])
    assert frozen["attribution"].equals(free["attribution"]) and free["attribution"].abs().max() > 0
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


def test_gradients_match_autograd(gpt2_64, pair):
    clean, _ = pair
    metric = logit_diff(3, 50)
    names = ["blocks.0.attn.hook_z", "blocks.2.hook_resid_mid"]
    m, acts, grads = activations_and_gradients(gpt2_64, clean, metric, names)
    kept = {}
    with gpt2_64.hooks([(n, lambda x, hook: kept.setdefault(hook.name, x)) for n in names]):
        again = metric(gpt2_64(clean))
        expected = torch.autograd.grad(again, [kept[n] for n in names])
    assert float(m) == float(again.detach())
    for n, g in zip(names, expected):
        torch.testing.assert_close(grads[n], g, atol=0, rtol=0)
        torch.testing.assert_close(acts[n], kept[n].detach(), atol=0, rtol=0)


@every_family
def test_every_family(model, pair):
    """One row per layer, head and position; the gradients behind them are autograd's."""
    clean, corrupted = pair
    metric = logit_diff(3, 50)
    df = attribution_patching(model, clean, corrupted, metric, sites=["resid_pre", "head"])
    heads = sum(model.cfg.has_heads(l) for l in range(model.cfg.n_layers)) * model.cfg.n_heads
    assert len(df) == (model.cfg.n_layers + heads) * clean.shape[1]
    assert df["attribution"].notna().all() and df["attribution"].abs().max() > 0
    names = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post"]
    _, _, grads = activations_and_gradients(model, corrupted, metric, names)
    kept = {}
    with model.hooks([(n, lambda x, hook: kept.setdefault(hook.name, x)) for n in names]), torch.enable_grad():
        logits = model(corrupted)
        expected = torch.autograd.grad(metric(logits), [kept[n] for n in names], allow_unused=True)
    for n, g in zip(names, expected):
        torch.testing.assert_close(grads[n], g, atol=1e-7, rtol=1e-5)


def test_bad_arguments(gpt2_64, pair):
    clean, corrupted = pair
    with pytest.raises(ValueError, match="unknown attribution patching site"):
        attribution_patching(gpt2_64, clean, corrupted, logit_diff(1, 2), sites=["resid"])
    with pytest.raises(ValueError, match="same length"):
        attribution_patching(gpt2_64, clean, corrupted[:, :-1], logit_diff(1, 2))
    with pytest.raises(ValueError, match="scalar tensor"):
        attribution_patching(gpt2_64, clean, corrupted, lambda logits: 1.0)

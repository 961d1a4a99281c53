"""SAE features through the intervention APIs: ablation (zero, mean, resample), steering, patching, attribution
patching per feature, direct logit attribution, and top activations, each against a hand computation."""

from __future__ import annotations

import pytest
import torch
from families import family_model_of
from test_saes_splice import relu_sae, toks

from lenskit.intervene.interventions import ablation_hooks, resample_indices
from lenskit.saes.features import (
    Feature,
    feature_attribution,
    feature_logit_attribution,
    feature_patching_hooks,
    steering_hooks,
    top_activations,
)

HOOK = "blocks.1.hook_resid_pre"


@pytest.fixture(scope="module")
def setup():
    model = family_model_of("gpt2").model
    sae = relu_sae(model.cfg.d_model)
    t = toks()
    with torch.no_grad():
        _, cache = model.run_with_cache(t, [HOOK])
    x = cache[HOOK]
    f = torch.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc)
    i = int(f.sum((0, 1)).argmax())
    return model, sae, t, f, i


def shifted(model, t, delta):  # the run with `delta` [batch?, pos?, d_model] added at HOOK
    return model.run_with_hooks(t, fwd_hooks=[(HOOK, lambda x, hook: x + delta)])


@torch.no_grad()
def test_zero_and_mean_ablation_of_a_feature(setup):
    model, sae, t, f, i = setup
    ref = toks(7).flip(0) + 2
    with pytest.raises(KeyError, match="spliced"):
        ablation_hooks(model, Feature(sae, i))
    with model.saes([sae]):
        zero = model.run_with_hooks(t, fwd_hooks=ablation_hooks(model, Feature(sae, i)))
        mean = model.run_with_hooks(t, fwd_hooks=ablation_hooks(model, Feature(sae, i), mode="mean", reference=ref))
        resampled = model.run_with_hooks(t, fwd_hooks=ablation_hooks(model, Feature(sae, i), mode="resample", reference=ref, seed=3))
    torch.testing.assert_close(zero, shifted(model, t, -f[..., i : i + 1] * sae.W_dec[i]), atol=1e-5, rtol=1e-5)
    _, rc = model.run_with_cache(ref, [HOOK])
    f_ref = torch.relu((rc[HOOK] - sae.b_dec) @ sae.W_enc + sae.b_enc)[..., i]
    torch.testing.assert_close(mean, shifted(model, t, (f_ref.mean() - f[..., i : i + 1]) * sae.W_dec[i]), atol=1e-5, rtol=1e-5)
    rows = resample_indices(ref.shape[0], t.shape[0], 3)
    torch.testing.assert_close(resampled, shifted(model, t, (f_ref[rows][..., None] - f[..., i : i + 1]) * sae.W_dec[i]),
                               atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_steering_adds_the_decoder_direction(setup):
    model, sae, t, _, i = setup
    got = model.run_with_hooks(t, fwd_hooks=steering_hooks(Feature(sae, i), 3.0, positions=[2]))
    delta = torch.zeros(t.shape[1], model.cfg.d_model)
    delta[2] = 3.0 * sae.W_dec[i]
    torch.testing.assert_close(got, shifted(model, t, delta))


@torch.no_grad()
def test_patching_a_feature_from_another_run(setup):
    model, sae, t, f, i = setup
    other = t.flip(1)
    with model.saes([sae]):
        _, source = model.run_with_cache(other)
        got = model.run_with_hooks(t, fwd_hooks=feature_patching_hooks(model, source, Feature(sae, i), positions=[1, 3]))
    f_other = source[f"{HOOK}.hook_sae_acts_post"][..., i]
    delta = torch.zeros_like(f[..., i])
    delta[:, [1, 3]] = f_other[:, [1, 3]] - f[:, [1, 3], i]
    torch.testing.assert_close(got, shifted(model, t, delta[..., None] * sae.W_dec[i]), atol=1e-5, rtol=1e-5)


def test_feature_attribution_matches_autograd(setup):
    model, sae, t, f, _ = setup
    clean, corrupted = t, t.flip(1)

    def metric(logits):
        return logits[:, -1, 5].sum() - logits[:, -1, 7].sum()

    df = feature_attribution(model, clean, corrupted, metric, [sae], per_position=True)
    # By hand: the corrupted run with its feature activations as a leaf, the SAE's error held at its value.
    with torch.no_grad():
        _, cc = model.run_with_cache(corrupted, [HOOK])
    xc = cc[HOOK]
    fc = torch.relu((xc - sae.b_dec) @ sae.W_enc + sae.b_enc).requires_grad_(True)
    err = xc - (fc.detach() @ sae.W_dec + sae.b_dec)
    m = metric(model.run_with_hooks(corrupted, fwd_hooks=[(HOOK, lambda x, hook: fc @ sae.W_dec + sae.b_dec + err)]))
    (g,) = torch.autograd.grad(m, fc)
    with torch.no_grad():
        _, cl = model.run_with_cache(clean, [HOOK])
    f_clean = torch.relu((cl[HOOK] - sae.b_dec) @ sae.W_enc + sae.b_enc)
    want = ((f_clean - fc.detach()) * g).sum(0)  # [pos, d_sae]
    got = torch.zeros_like(want, dtype=torch.float64)
    got[df["position"].astype(int).to_numpy(copy=True), df["feature"].to_numpy(copy=True)] = torch.tensor(df["attribution"].to_numpy(copy=True))
    torch.testing.assert_close(got, want.double(), atol=1e-5, rtol=1e-4)
    assert df["attribution"].abs().is_monotonic_decreasing


@torch.no_grad()
def test_feature_logit_attribution_by_hand(setup):
    model, sae, t, f, _ = setup
    with model.saes([sae]):
        _, cache = model.run_with_cache(t)
    df = feature_logit_attribution(model, cache, sae, token=5, minus=7, top=None)
    ln = model.ln_final
    scale = cache["ln_final.hook_scale"][:, -1]  # [batch, 1]
    u = model.unembed.weight[5] - model.unembed.weight[7]
    for row in df.head(5).itertuples():
        w = f[row.batch, -1, row.feature] * sae.W_dec[row.feature]
        want = ((w - w.mean()) / scale[row.batch] * ln.gain) @ u
        assert row.attribution == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    assert set(df["feature"][df["batch"] == 0]) == set(torch.nonzero(f[0, -1] > 0).flatten().tolist())


@torch.no_grad()
def test_top_activations_table(setup):
    model, sae, t, f, i = setup
    df = top_activations(model, sae, t, top=3, context=2, batch_size=1)
    assert list(df.columns) == ["feature", "rank", "activation", "batch", "position", "token", "context", "count", "rate"]
    mine = df[df.feature == i]
    assert mine["count"].iloc[0] == int((f[..., i] > 0).sum())
    assert mine["activation"].iloc[0] == pytest.approx(float(f[..., i].max()), rel=1e-5)
    b, p = int(mine["batch"].iloc[0]), int(mine["position"].iloc[0])
    assert float(f[b, p, i]) == pytest.approx(float(f[..., i].max()), rel=1e-5)
    assert set(df.feature) == set(torch.nonzero((f > 0).flatten(0, 1).any(0)).flatten().tolist())

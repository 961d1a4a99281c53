"""The feature lens: a feature's direction through the logit and tuned lenses (by hand from the lens's weights),
its write through the model (by hand at the stream it writes), the heatmap, and `lenskit features`."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from sae_files import saelens_folder

import lenskit
from lenses import LogitLens, TunedLens
from lenses.cli import main
from lenses.features import feature_lens, first_stream
from lenses.plots import feature_lens_heatmap
from lenskit.saes import SAE
from lenskit.saes.features import Feature

HOOK = "blocks.3.hook_resid_pre"


@pytest.fixture(scope="module")
def model():
    return lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")


@pytest.fixture(scope="module")
def sae_folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sae")
    saelens_folder(folder, model.cfg.d_model, 48, hook=HOOK)
    return folder


def test_direction_through_logit_and_tuned(model, sae_folder):
    sae = SAE.load(sae_folder)
    tuned = TunedLens(model)
    with torch.no_grad():
        for p in tuned.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    frame = feature_lens(model, Feature(sae, 5), {"logit": LogitLens(model), "tuned": tuned}, top_k=4)
    assert sorted(frame.layer.unique()) == list(range(3, model.cfg.n_layers + 1)) and first_stream(model, HOOK) == 3
    v = sae.W_dec[5]
    ln = model.ln_final
    by_hand = lambda u: ((u - u.mean()) * ln.gain) @ model.unembed.weight.T  # noqa: E731
    want = by_hand(v).topk(4)
    logit = frame.query("lens == 'logit' and kind == 'promoted'")
    for _, rows in logit.groupby("layer"):  # the raw unembedding: the same at every stream
        assert rows.token_id.tolist() == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(rows.logit.tolist()), want.values.float(), rtol=1e-5, atol=1e-5)
    A = tuned.translator(4)
    moved = v + A.weight @ v  # (I + A) v, the bias dropped: a direction has no offset
    want4 = by_hand(moved).topk(4, largest=False)
    got4 = frame.query("lens == 'tuned' and layer == 4 and kind == 'suppressed'")
    assert got4.token_id.tolist() == want4.indices.tolist()
    torch.testing.assert_close(torch.tensor(got4.logit.tolist()), want4.values.float(), rtol=1e-4, atol=1e-5)
    fig = feature_lens_heatmap(frame)
    assert len(fig.data) == 2 and fig.data[0].z.shape == (model.cfg.n_layers - 2, 4)


def test_stream_mode_at_the_stream_written(model, sae_folder):
    sae = SAE.load(sae_folder)
    tokens = model.to_tokens("def f(x):\n    return x + 1\n")
    frame = feature_lens(model, Feature(sae, 7), {"logit": LogitLens(model)}, mode="stream", tokens=tokens, alpha=2.0,
                         top_k=3)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, [HOOK])
        h = cache[HOOK]
        want = (model.readout(h + 2.0 * sae.W_dec[7]) - model.readout(h)).float().mean((0, 1)).topk(3)
    got = frame.query("layer == 3 and kind == 'promoted'")
    assert got.token_id.tolist() == want.indices.tolist()
    torch.testing.assert_close(torch.tensor(got.logit.tolist()), want.values, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="tokens"):
        feature_lens(model, Feature(sae, 7), {"logit": LogitLens(model)}, mode="stream")


def test_cli(sae_folder, tmp_path, capsys):
    csv, html = tmp_path / "f.csv", tmp_path / "f.html"
    assert main(["features", "--model", "stdlib-gpt2", "--sae", str(sae_folder), "--feature", "3", "--lens", "logit",
                 "--top-k", "2", "--csv", str(csv), "--out", str(html)]) == 0
    frame = pd.read_csv(csv)
    assert len(frame) == 4 * 2 * 2 and set(frame.kind) == {"promoted", "suppressed"} and html.stat().st_size > 1000
    assert "promoted" in capsys.readouterr().out
    other = tmp_path / "other"
    saelens_folder(other, 64, 48, hook=HOOK)
    assert main(["features", "--model", "stdlib-gpt2", "--sae", str(other), "--feature", "3"]) == 2
    err = capsys.readouterr().err
    assert "d_model is 192" in err and err.count("\n") == 1


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_5_text"])
def test_direction_through_an_rmsnorm_readout(family):
    from families import family_model_of
    from test_saes_splice import relu_sae

    model = family_model_of(family).model
    sae = relu_sae(model.cfg.d_model)
    frame = feature_lens(model, Feature(sae, 2), {"logit": LogitLens(model)}, top_k=3)
    want = ((sae.W_dec[2] * model.ln_final.gain) @ model.unembed.weight.T).topk(3)  # RMSNorm: no centring
    got = frame.query("layer == 1 and kind == 'promoted'")
    assert got.token_id.tolist() == want.indices.tolist()
    torch.testing.assert_close(torch.tensor(got.logit.tolist()), want.values.float(), rtol=1e-4, atol=1e-5)

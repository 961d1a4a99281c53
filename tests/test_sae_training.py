"""`lenskit train-sae`: a TopK SAE trained on a tiny export; its files load (SAELens layout) and compute TopK; its card's
metrics match a hand evaluation; an interrupted run resumes to the same weights as an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch

import lenses.sae_training as st
from lenses.activation_export import export_activations
from lenses.cli import main
from lenskit.saes import SAE

HOOK = "blocks.1.hook_resid_pre"
RECIPE = st.SAERecipe(latents=48, k=4, tokens=24 * 16, batch_windows=4, eval_windows=4, lr=1e-3)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from families import family_model_of

    model = family_model_of("gpt2").model
    windows = torch.randint(1, 60, (24, 16), generator=torch.Generator().manual_seed(0))
    out = tmp_path_factory.mktemp("acts")
    export_activations(model, windows, [HOOK], out, progress=False)
    return model, out


def test_train_card_and_metrics(export, tmp_path):
    model, acts = export
    sae = st.train_sae(acts, HOOK, tmp_path / "sae", RECIPE, model, progress=False)
    again = SAE.load(tmp_path / "sae")
    assert again.hook_name == HOOK and again.cfg.architecture == "topk" and again.cfg.k == 4
    meta = json.loads((tmp_path / "sae" / "training.json").read_text())
    rows = st.ActivationDataset(acts, HOOK)
    x = torch.cat([rows.window(w)[0] for w in range(20, 24)]).float()
    toks = torch.stack([rows.window(w)[1] for w in range(20, 24)])
    W = dict(again.named_parameters())
    pre = (x - W["b_dec"]) @ W["W_enc"] + W["b_enc"]
    kth = pre.sort(-1, descending=True).values[:, 3:4]
    f = torch.relu(pre) * (pre >= kth)
    x_hat = f @ W["W_dec"] + W["b_dec"]
    ev = meta["eval"]
    assert ev["fvu"] == pytest.approx(float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum()), rel=1e-4)
    assert ev["l0"] == pytest.approx(float((f > 0).sum(-1).float().mean()), rel=1e-5)
    assert ev["fvu"] < 1.0
    with torch.no_grad():
        clean = float(model(toks, return_type="loss"))
        spliced = float(model.run_with_hooks(toks, fwd_hooks=[(HOOK, lambda h, hook: again(h))], return_type="loss"))
    assert ev["ce_increase"] == pytest.approx(spliced - clean, rel=1e-4, abs=1e-6)
    card = (tmp_path / "sae" / "README.md").read_text()
    assert "library_name: lenskit" in card and "FVU" in card and "CE increase" in card and f"{meta['training_tokens']:,}" in card
    torch.testing.assert_close(sae.encode(x), again.encode(x))


def test_resume_gives_the_same_weights(export, tmp_path, monkeypatch):
    _, acts = export
    whole = st.train_sae(acts, HOOK, tmp_path / "a", RECIPE, None, progress=False)
    monkeypatch.setattr(st, "CHECKPOINT_EVERY", 2)
    real, calls = st._windows, {"n": 0}

    def dies(rows, idx):
        calls["n"] += 1
        if calls["n"] == 5 + 1:  # init reads once, then steps 1..4; step 5 is killed
            raise KeyboardInterrupt
        return real(rows, idx)

    monkeypatch.setattr(st, "_windows", dies)
    with pytest.raises(KeyboardInterrupt):
        st.train_sae(acts, HOOK, tmp_path / "b", RECIPE, None, progress=False)
    assert json.loads((tmp_path / "b" / st.STATE).read_text())["step"] == 4
    monkeypatch.setattr(st, "_windows", real)
    resumed = st.train_sae(acts, HOOK, tmp_path / "b", RECIPE, None, progress=False)
    for (n, p), (_, q) in zip(whole.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    other = st.SAERecipe(**{**RECIPE.__dict__, "k": 5})
    with pytest.raises(ValueError, match="another recipe"):
        st.train_sae(acts, HOOK, tmp_path / "b", other, None, progress=False)


def test_cli_refuses_a_foreign_export(export, tmp_path, capsys):
    _, acts = export
    code = main(["train-sae", "--model", "stdlib-gpt2", "--activations", str(acts), "--hook", HOOK, "--out", str(tmp_path / "s")])
    assert code == 2 and "another model" in capsys.readouterr().err


def test_the_shipped_sae():
    import lenskit

    model = lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")
    sae = SAE.load("stdlib-gpt2-sae-L3")
    assert sae.hook_name == "blocks.3.hook_resid_pre" and sae.cfg.k == 32 and sae.d_sae == 1536
    from lenskit.saes.formats import embedded_sae_folder

    folder = embedded_sae_folder("stdlib-gpt2-sae-L3")
    card = (folder / "README.md").read_text()
    ev = json.loads((folder / "training.json").read_text())["eval"]
    assert ev["fvu"] < 0.3 and ev["dead_fraction"] < 0.05 and f"{ev['ce_increase']:.4f}" in card
    text = "import os\n\n\ndef main(path):\n    with open(path) as f:\n        return [line.strip() for line in f]\n"
    tokens = model.to_tokens(text)
    with torch.no_grad():
        plain = model(tokens)
        with model.saes([sae]):
            spliced, cache = model.run_with_cache(tokens)
        torch.testing.assert_close(spliced, plain, atol=1e-4, rtol=1e-4)
        x = cache["blocks.3.hook_resid_pre"]
        recons = cache["blocks.3.hook_resid_pre.hook_sae_recons"]
        fvu = float((x - recons).pow(2).sum() / (x - x.mean((0, 1))).pow(2).sum())
        assert fvu < 0.5
        assert int((cache["blocks.3.hook_resid_pre.hook_sae_acts_post"] > 0).sum(-1).max()) <= 32


def test_cli_trains_and_resumes(export, tmp_path, capsys):
    _, acts = export
    argv = ["train-sae", "--model", "none", "--activations", str(acts), "--hook", HOOK, "--out", str(tmp_path / "s"),
            "--k", "4", "--latents", "48", "--tokens", "256", "--batch-windows", "4", "--eval-windows", "4", "--quiet"]
    assert main(argv) == 0
    first = SAE.load(tmp_path / "s")
    assert main(argv) == 0  # a finished run: reused from its checkpoint, the same weights
    torch.testing.assert_close(SAE.load(tmp_path / "s").W_enc, first.W_enc, rtol=0, atol=0)
    assert "CE increase" not in (tmp_path / "s" / "README.md").read_text()  # --model none: no CE metric
    assert "topk, k=4" in capsys.readouterr().out

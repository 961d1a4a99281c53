"""`lenskit train-lens` and `lenskit eval-lens`, run in-process through the console entry point."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from lens_fixtures import write_text_folder, write_tiny_model

from lenses.cli import main
from lenses.tuned import model_fingerprint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    write_tiny_model(root / "model")
    write_text_folder(root / "train", n=60, seed=0)
    write_text_folder(root / "heldout", n=20, seed=1)
    return root


def test_train_then_eval_writes_a_lens_and_a_per_layer_csv(files, tmp_path, capsys):
    out = tmp_path / "lens"
    args = ["train-lens", "--model", str(files / "model"), "--data", str(files / "train"), "--out", str(out),
            "--steps", "10", "--tokens-per-step", "128", "--ctx", "16", "--seed", "1", "--quiet"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["tokens_seen"] == 10 * 128 and config["recipe"]["seed"] == 1 and config["recipe"]["optimizer"] == "sgd"
    assert config["data"]["n_files"] == 60 and len(config["data"]["files"]) == 60
    assert config["data"]["files"][0]["path"].endswith("snippet_000.py")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "lens.safetensors"]

    assert main(args) == 0  # rerun on a finished folder: nothing to do, and nothing claimed as written
    printed = capsys.readouterr().out
    assert "already trained (10 steps); nothing to do" in printed and "wrote" not in printed
    card = (out / "README.md").read_text()
    assert "Not evaluated yet" in card

    csv = tmp_path / "eval.csv"
    assert main(["eval-lens", "--model", str(files / "model"), "--lens", str(out), "--data", str(files / "heldout"),
                 "--tokens", "320", "--ctx", "16", "--csv", str(csv), "--card", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "kl_tuned" in printed and "prediction depth" in printed and "README.md" in printed
    table = pd.read_csv(csv)
    for col in ("layer", "kl_logit", "kl_tuned", "ce_logit", "ce_tuned", "kl_logit_bpb", "kl_tuned_bpb"):
        assert col in table.columns
    assert table["layer"].tolist() == [0, 1, 2, 3]
    assert (table["kl_tuned"][:-1] < table["kl_logit"][:-1]).all()
    # --card: the same numbers in the model card's table and in config.json, and the lens still loads.
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: lenskit\n") and "- tuned-lens" in card and "Not evaluated" not in card
    for row in table.itertuples():
        assert f"| {row.layer} | {row.kl_logit:.4f} | {row.kl_tuned:.4f} | {row.ce_logit:.4f} | {row.ce_tuned:.4f} |" in card
    saved = json.loads((out / "config.json").read_text())["eval"]
    assert saved["n_tokens"] == 320 and [r["kl_tuned"] for r in saved["table"]] == pytest.approx(table["kl_tuned"].tolist())
    assert main(["lens", "x = 1", "--model", str(files / "model"), "--lens", str(out)]) == 0


def test_too_few_tokens_fails_before_training(files, tmp_path, capsys):
    code = main(["train-lens", "--model", str(files / "model"), "--data", str(files / "heldout"), "--out", str(tmp_path / "x"),
                 "--steps", "1000", "--tokens-per-step", "64", "--ctx", "16", "--quiet"])
    assert code == 2
    assert "too few tokens" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_eval_with_a_lens_for_another_model_names_both_fingerprints(files, tmp_path, capsys):
    import lenskit

    out = tmp_path / "lens"
    assert main(["train-lens", "--model", str(files / "model"), "--data", str(files / "train"), "--out", str(out),
                 "--steps", "2", "--tokens-per-step", "32", "--ctx", "16", "--quiet"]) == 0
    other = write_tiny_model(tmp_path / "other", seed=5)
    code = main(["eval-lens", "--model", str(other), "--lens", str(out), "--data", str(files / "heldout"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert model_fingerprint(lenskit.HookedTransformer.from_pretrained(other)) in err
    assert json.loads((out / "config.json").read_text())["model_fingerprint"] in err


def test_lens_command_reads_a_trained_tuned_lens_folder(files, tmp_path, capsys):
    import lenskit
    from lenses import TunedLens
    from lenses.metrics import forward_kl

    out = tmp_path / "lens"
    assert main(["train-lens", "--model", str(files / "model"), "--data", str(files / "train"), "--out", str(out),
                 "--steps", "4", "--tokens-per-step", "64", "--ctx", "16", "--quiet"]) == 0
    csv = tmp_path / "traj.csv"
    prompt = "def f1(alpha, beta):\n    alpha = beta + 1"
    assert main(["lens", prompt, "--model", str(files / "model"), "--lens", str(out), "--csv", str(csv)]) == 0
    rows = pd.read_csv(csv)
    model = lenskit.HookedTransformer.from_pretrained(files / "model")
    tuned = TunedLens.load(out, model)
    logits, cache = model.run_with_cache(prompt)
    for l in range(model.cfg.n_layers):  # the CSV's KL is the tuned lens's, not the logit lens's
        expected = forward_kl(logits, tuned(cache["resid_pre", l], l))[0].detach()
        got = rows[rows.layer == l].sort_values("position")["kl_to_final"].to_numpy()
        assert got == pytest.approx(expected.numpy(), abs=1e-5)


def test_train_lens_bias_only_writes_a_bias_only_lens_and_a_full_rerun_is_refused(files, tmp_path, capsys):
    from safetensors.torch import load_file

    import lenskit
    from lenses import TunedLens

    out = tmp_path / "lens"
    args = ["train-lens", "--model", str(files / "model"), "--data", str(files / "train"), "--out", str(out),
            "--steps", "6", "--tokens-per-step", "64", "--ctx", "16", "--quiet"]
    assert main([*args, "--bias-only"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["bias_only"] is True and config["run_identity"]["bias_only"] is True
    weights = load_file(str(out / "lens.safetensors"))
    assert sorted(weights) == [f"translators.{l}.bias" for l in range(3)]
    assert "Bias-only tuned lens" in (out / "README.md").read_text()
    lens = TunedLens.load(out, lenskit.HookedTransformer.from_pretrained(files / "model"))
    assert lens.bias_only and lens.translators[0].bias.abs().max() > 0
    capsys.readouterr()
    assert main(args) == 2  # the same folder without --bias-only: another run
    err = capsys.readouterr().err
    assert "bias_only (saved true, now false) differ" in err and len(err.strip().splitlines()) == 1
    assert main(["eval-lens", "--model", str(files / "model"), "--lens", f"tuned:{out}", "--data", str(files / "heldout"),
                 "--tokens", "160", "--ctx", "16", "--quiet"]) == 0
    assert "kl_tuned" in capsys.readouterr().out

"""`lenskit ablate`: the CSV agrees with transformers run with plain torch hooks; files and errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import transformers

from lenses.cli import main
from lenses.cli.ablate import DEFAULT_REFERENCE

PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from tiny_tokenizer import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_csv_matches_transformers_with_torch_hooks(folder, tmp_path, capsys):
    csv = tmp_path / "ablate.csv"
    assert main(["ablate", PROMPT, "--model", str(folder), "--block", "1", "--head", "2.3", "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    table = pd.read_csv(csv, keep_default_na=False)

    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tok = transformers.GPT2Tokenizer.from_pretrained(folder)
    ids = torch.tensor([tok.encode(PROMPT)])
    d_head = hf.config.n_embd // hf.config.n_head

    def zero_head3(module, args):
        x = args[0].clone()
        x[..., 3 * d_head:4 * d_head] = 0
        return (x, *args[1:])
    with torch.no_grad():
        clean = hf(ids).logits[0]
        handles = [hf.transformer.h[1].register_forward_hook(lambda m, args, out: args[0]),
                   hf.transformer.h[2].attn.c_proj.register_forward_pre_hook(zero_head3)]
        try:
            ablated = hf(ids).logits[0]
        finally:
            for h in handles:
                h.remove()
    n = ids.shape[1] - 1
    assert len(table) == n and list(table["position"]) == list(range(n))
    assert {"position", "input_token", "clean_top_token_id", "ablated_top_token_id", "clean_loss", "ablated_loss",
            "kl"} <= set(table.columns)
    assert list(table["input_token"]) == [tok.decode([i]) for i in ids[0, :-1].tolist()]
    np.testing.assert_array_equal(table["clean_top_token_id"], clean[:-1].argmax(-1).numpy())
    np.testing.assert_array_equal(table["ablated_top_token_id"], ablated[:-1].argmax(-1).numpy())
    np.testing.assert_allclose(table["clean_loss"], F.cross_entropy(clean[:-1], ids[0, 1:], reduction="none"), atol=1e-5)
    np.testing.assert_allclose(table["ablated_loss"], F.cross_entropy(ablated[:-1], ids[0, 1:], reduction="none"), atol=1e-5)
    logp, logq = clean[:-1].log_softmax(-1), ablated[:-1].log_softmax(-1)
    np.testing.assert_allclose(table["kl"], (logp.exp() * (logp - logq)).sum(-1), atol=1e-5)
    assert "block 1, head 2.3 (zero)" in out
    assert f"{table['clean_loss'].mean():.3f} -> {table['ablated_loss'].mean():.3f}" in out


def test_mean_and_resample_with_a_reference_and_a_figure(folder, tmp_path, capsys):
    ref = tmp_path / "ref.py"
    ref.write_text("import os\nfor i in range(10):\n    print(i, os.sep)\n" * 40)
    out_html = tmp_path / "fig.html"
    args = ["ablate", PROMPT, "--model", str(folder), "--mlp", "0", "--attn", "2", "--reference", str(ref)]
    assert main([*args, "--mode", "mean", "--out", str(out_html), "--color", "kl"]) == 0
    assert out_html.stat().st_size > 100_000 and "plotly" in out_html.read_text()[:5000].lower()
    mean_out = capsys.readouterr().out
    assert "mean over" in mean_out
    csvs = []
    for seed in (0, 0, 1):
        csv = tmp_path / f"r{len(csvs)}.csv"
        assert main([*args, "--mode", "resample", "--seed", str(seed), "--csv", str(csv)]) == 0
        csvs.append(pd.read_csv(csv))
    pd.testing.assert_frame_equal(csvs[0], csvs[1])  # the same seed, the same numbers
    assert not np.allclose(csvs[0]["ablated_loss"], csvs[2]["ablated_loss"])
    np.testing.assert_allclose(csvs[0]["clean_loss"], csvs[2]["clean_loss"])  # the clean run does not depend on it


def test_default_reference_is_held_out_stdlib():
    from lenskit.io.data import is_heldout

    assert all(is_heldout(name) for name in DEFAULT_REFERENCE)


def test_errors(folder, capsys):
    assert main(["ablate", PROMPT, "--model", str(folder)]) == 2
    assert "nothing to ablate" in capsys.readouterr().err
    assert main(["ablate", PROMPT, "--model", str(folder), "--head", "7.1"]) == 2
    assert "layer 7 is out of range" in capsys.readouterr().err
    assert main(["ablate", PROMPT, "--model", str(folder), "--head", "1.9"]) == 2
    assert "head 9 is out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ablate", PROMPT, "--model", str(folder), "--head", "1"])
    assert "LAYER.HEAD" in capsys.readouterr().err


@pytest.mark.slow
def test_mean_mode_on_the_embedded_model_reads_the_default_reference(default_model_path, tmp_path, capsys):
    csv = tmp_path / "mean.csv"
    assert main(["ablate", "import os\nos.path.join(a, b)\n", "--block", "3", "--mode", "mean", "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert "mean over 32 reference windows of 128 tokens" in out
    table = pd.read_csv(csv)
    assert (table["kl"] >= 0).all() and (table["kl"] > 0).any()

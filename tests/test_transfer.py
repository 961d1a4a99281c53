"""Layer transfer: the diagonal is the evaluation's own KL, entries match a transformers longhand, an untrained
lens gives the logit lens in every row; the figure, the CLI, and the refusal of a lens without translators."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
import torch.nn.functional as F
from lens_fixtures import random_tuned

from lenses import LogitLens, TunedLens, plots
from lenses.evaluation import evaluate_windows, per_layer
from lenses.transfer import layer_transfer, transfer_penalty


@pytest.fixture
def windows():
    return torch.randint(0, 101, (5, 12), generator=torch.Generator().manual_seed(3))


def test_diagonal_is_the_evaluations_per_layer_kl_of_the_tuned_lens(model, windows):
    tuned = random_tuned(model, scale=0.2)
    matrix = layer_transfer(model, tuned, windows, batch=2, progress=False)
    n = model.cfg.n_layers
    assert matrix.shape == (n, n) and list(matrix.index) == list(range(n)) and list(matrix.columns) == list(range(n))
    assert matrix.index.name == "translator" and matrix.columns.name == "stream"
    assert matrix.attrs == {"n_tokens": windows.numel(), "n_windows": len(windows)}
    table = per_layer(evaluate_windows(model, {"tuned": tuned}, windows, batch=3, progress=False))
    np.testing.assert_allclose(np.diag(matrix.to_numpy()), table["kl_tuned"][:n].to_numpy(), rtol=1e-6, atol=1e-7)
    off = matrix.to_numpy()[~np.eye(n, dtype=bool)]
    assert (np.abs(off - np.diag(matrix.to_numpy()).mean()) > 1e-3).any()  # not every entry the same


def test_off_diagonal_entries_match_a_longhand_from_transformers_hidden_states(model, hf_model, windows):
    tuned = random_tuned(model, seed=1, scale=0.2)
    matrix = layer_transfer(model, tuned, windows, progress=False)
    out = hf_model(windows, output_hidden_states=True)
    final = out.logits.log_softmax(-1)
    for i, j in ((0, 2), (2, 0), (1, 2)):
        h, t = out.hidden_states[j], tuned.translators[i]
        logp = hf_model.lm_head(hf_model.transformer.ln_f(h + h @ t.weight.T + t.bias)).log_softmax(-1)
        kl = F.kl_div(logp, final, log_target=True, reduction="none").sum(-1).mean()  # KL(final || lens), every token
        assert matrix.loc[i, j] == pytest.approx(kl.item(), rel=1e-4, abs=1e-6), (i, j)


def test_an_untrained_lens_gives_the_logit_lens_kl_in_every_row(model, windows):
    matrix = layer_transfer(model, TunedLens(model), windows, progress=False)
    logit = per_layer(evaluate_windows(model, [LogitLens(model)], windows, progress=False))["kl_logit"].to_numpy()
    n = model.cfg.n_layers
    assert (logit[:n] > 1e-3).all()  # the logit lens is far from the output at these streams
    for i in range(n):
        np.testing.assert_allclose(matrix.loc[i].to_numpy(), logit[:n], rtol=1e-6, atol=1e-7)
    assert np.allclose(transfer_penalty(matrix).to_numpy(), 0.0, atol=1e-6)


def test_penalty_subtracts_each_streams_own_translator():
    m = pd.DataFrame([[1.0, 5.0], [2.0, 3.0]], index=pd.Index([0, 1], name="translator"),
                     columns=pd.Index([0, 1], name="stream"))
    p = transfer_penalty(m)
    assert p.to_numpy().tolist() == [[0.0, 2.0], [1.0, 0.0]]
    fig = plots.transfer_heatmap(p)
    assert isinstance(fig, go.Figure) and fig.data[0].type == "heatmap"
    heat = fig.data[0]
    assert np.asarray(heat.customdata).tolist() == [[0.0, 2.0], [1.0, 0.0]] and list(heat.text[0]) == ["0.00", "2.00"]
    # No negatives: a log colour scale from 0.01 nats (the zeros at its floor), the values themselves in the text.
    np.testing.assert_allclose(np.asarray(heat.z), np.log10([[0.01, 2.0], [1.0, 0.01]]))
    assert heat.zmid is None and heat.zmin == -2.0
    assert list(fig.layout.yaxis.ticktext) == ["emb", "1"]
    negative = plots.transfer_heatmap(p - 0.5)  # a translator reading a stream better than its own: diverging
    assert negative.data[0].zmid == 0.0 and negative.data[0].zmin == -negative.data[0].zmax
    with pytest.raises(ValueError, match="square"):
        plots.transfer_heatmap(m.iloc[:1])


def test_a_lens_without_translators_is_refused_in_one_line(model, windows):
    with pytest.raises(ValueError) as refused:
        layer_transfer(model, LogitLens(model), windows, progress=False)
    message = str(refused.value)
    assert "\n" not in message and "logit lens has none" in message and "TunedLens" in message


@pytest.mark.slow  # trains a small lens, then runs eval-lens twice
def test_eval_lens_writes_the_matrix_csv_and_the_figure(tmp_path, capsys):
    from lens_fixtures import write_text_folder, write_tiny_model

    from lenses.cli import main

    model_dir = write_tiny_model(tmp_path / "model")
    write_text_folder(tmp_path / "train", n=40, seed=0)
    write_text_folder(tmp_path / "heldout", n=12, seed=1)
    lens = tmp_path / "lens"
    assert main(["train-lens", "--model", str(model_dir), "--data", str(tmp_path / "train"), "--out", str(lens),
                 "--steps", "4", "--tokens-per-step", "64", "--ctx", "16", "--quiet"]) == 0
    csv, fig = tmp_path / "out" / "transfer.csv", tmp_path / "out" / "transfer.html"
    common = ["eval-lens", "--model", str(model_dir), "--data", str(tmp_path / "heldout"), "--tokens", "160", "--ctx", "16",
              "--quiet"]
    assert main([*common, "--lens", f"tuned:{lens}", "--layer-transfer", str(csv), "--layer-transfer-out", str(fig)]) == 0
    printed = capsys.readouterr().out
    assert "layer transfer" in printed and "kl_tuned" in printed  # the matrix, then the usual table
    matrix = pd.read_csv(csv, index_col="translator")
    assert matrix.shape == (3, 3) and list(matrix.columns) == ["0", "1", "2"]
    import lenskit
    from lenses.evaluation import heldout_windows
    from lenskit.io.data import load_token_stream

    m = lenskit.HookedTransformer.from_pretrained(model_dir)
    windows = heldout_windows(load_token_stream([tmp_path / "heldout"], m.tokenizer), 160, 16, m.cfg.n_ctx)
    again = layer_transfer(m, TunedLens.load(lens, m), windows, progress=False)
    np.testing.assert_allclose(matrix.to_numpy(), again.to_numpy(), rtol=1e-5)  # the same windows as the evaluation
    html = fig.read_text()
    assert "plotly" in html and "layer transfer penalty" in html
    # Only a logit lens: refused, one line, nothing written.
    assert main([*common, "--lens", "logit", "--layer-transfer", str(tmp_path / "no.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no --lens is a tuned lens (got logit)" in err
    assert not (tmp_path / "no.csv").exists()
    with pytest.raises(SystemExit) as bad_name:  # argparse refuses a figure name it cannot write, before any work
        main([*common, "--lens", f"tuned:{lens}", "--layer-transfer-out", str(tmp_path / "x.txt")])
    assert bad_name.value.code == 2 and "expected a file name ending in .html" in capsys.readouterr().err


def test_the_cli_takes_the_one_tuned_lens_among_several(model):
    from lenses.cli.layer_transfer import tuned_among

    tuned = TunedLens(model)
    assert tuned_among({"logit": LogitLens(model), "tuned": tuned}) is tuned
    with pytest.raises(ValueError, match=r"reads one tuned lens, and --lens gives 2 \(a, b\)"):
        tuned_among({"logit": LogitLens(model), "a": tuned, "b": TunedLens(model)})

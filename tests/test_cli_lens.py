"""`lenskit lens` on a tiny saved model and on the embedded one: the table, the CSV and real figure files."""

import pandas as pd
import pytest
import torch

import lenskit
from lenses import LogitLens, Trajectory
from lenses.cli import main
from lenses.table import format_table
from tiny_tokenizer import save_tiny_model

PROMPT = "def add(a, b):\n    return a + b"
COLUMNS = ["layer", "position", "input_token", "top_token", "top_token_id", "top_prob", "entropy", "kl_to_final"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_csv_and_html(tiny_folder, tmp_path, capsys):
    csv, html = tmp_path / "x.csv", tmp_path / "x.html"
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--top-k", "3", "--csv", str(csv), "--out", str(html)]) == 0
    out = capsys.readouterr().out
    df = pd.read_csv(csv, keep_default_na=False)
    model = lenskit.HookedTransformer.from_pretrained(tiny_folder)
    n_pos, n_layers = len(model.to_tokens(PROMPT)[0]), model.cfg.n_layers
    assert list(df.columns[:8]) == ["layer", "position", "input_token", "input_token_id", "top_token", "top_token_id", "top_prob", "entropy"]
    assert set(COLUMNS) <= set(df.columns) and "top3_prob" in df.columns and "top4_prob" not in df.columns
    assert len(df) == (n_layers + 1) * n_pos
    # the same numbers as the library computes
    want = Trajectory.from_prompt(LogitLens(model), PROMPT, top_k=3).to_frame()
    assert df.top_token_id.tolist() == want.top_token_id.tolist()
    assert df.kl_to_final.to_numpy() == pytest.approx(want.kl_to_final.to_numpy(), abs=1e-6)
    # the printed table is the layers x positions grid of top-1 tokens
    assert format_table(want) in out and f"layer {n_layers}" in out and "input" in out
    assert html.read_text().lower().startswith("<!doctype html>") and html.stat().st_size > 1_000_000


def test_table_wraps_and_shows_whitespace():
    frame = pd.DataFrame(dict(layer=[0, 0, 1, 1], position=[0, 1, 0, 1], input_token=["def", "\n  ", "def", "\n  "],
                              top_token=[" x", "y", "\t", "zzzzzzzzzzzz"]))
    table = format_table(frame, width=200)
    lines = table.splitlines()
    assert lines[0].split() == ["input", "def", "\\n··"] and lines[2].split() == ["layer", "0", "·x", "y"]
    assert lines[3].split() == ["layer", "1", "\\t", "zzzzzzz…"]
    narrow = format_table(frame, width=14)  # one position per block
    assert narrow.count("input") == 2


def test_errors(tiny_folder, tmp_path, capsys):
    assert main(["lens", "x", "--model", str(tiny_folder), "--out", str(tmp_path / "x.jpg")]) == 2
    assert "expected a file name ending in .html" in capsys.readouterr().err
    assert main(["lens", "x", "--model", str(tiny_folder), "--lens", str(tmp_path / "nope")]) == 2
    assert "neither 'logit' nor a folder" in capsys.readouterr().err
    assert main(["lens", "x" * 200, "--model", str(tiny_folder)]) == 2  # longer than n_ctx = 64
    assert "n_ctx" in capsys.readouterr().err


@pytest.mark.slow
def test_png(tiny_folder, tmp_path):
    png = tmp_path / "x.png"
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--out", str(png), "--color", "entropy"]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.slow
def test_default_model_pdf_and_csv(default_model_path, tmp_path, capsys):
    pdf, csv = tmp_path / "x.pdf", tmp_path / "x.csv"
    assert main(["lens", "import os\nimport sys\n\n\ndef main(", "--out", str(pdf), "--csv", str(csv)]) == 0  # --model defaults
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 10_000
    df = pd.read_csv(csv, keep_default_na=False)
    model = lenskit.HookedTransformer.from_pretrained(default_model_path)
    last = df[df.layer == model.cfg.n_layers].sort_values("position")
    with torch.no_grad():
        logits = model(model.to_tokens("import os\nimport sys\n\n\ndef main("))[0]
    assert last.top_token_id.tolist() == logits.argmax(-1).tolist()  # the last layer is the model's own prediction
    assert (last.kl_to_final.abs() < 1e-4).all()
    assert "logit lens" in capsys.readouterr().out


def test_tuned_lens_folder(tiny_folder, tmp_path):
    from lenses import TunedLens

    model = lenskit.HookedTransformer.from_pretrained(tiny_folder)
    tuned = TunedLens(model)
    with torch.no_grad():  # a non-trivial lens, so the CLI's output cannot pass for the logit lens's
        for p in tuned.parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    tuned.save(tmp_path / "lens")
    csv = tmp_path / "tuned.csv"
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--lens", str(tmp_path / "lens"), "--csv", str(csv)]) == 0
    df = pd.read_csv(csv, keep_default_na=False)
    want = Trajectory.from_prompt(tuned, PROMPT).to_frame()
    logit = Trajectory.from_prompt(LogitLens(model), PROMPT).to_frame()
    assert df.top_token_id.tolist() == want.top_token_id.tolist()
    assert df.kl_to_final.to_numpy() == pytest.approx(want.kl_to_final.to_numpy(), abs=1e-5)
    assert not (df.kl_to_final.to_numpy() == pytest.approx(logit.kl_to_final.to_numpy(), abs=1e-3))

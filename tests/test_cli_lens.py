"""`lenskit lens` on a tiny saved model and on the embedded one: the table, the CSV and real figure files."""

import html
import os

import pandas as pd
import pytest
import torch
from tiny_tokenizer import save_tiny_model

import lenskit
from lenses import LogitLens, Trajectory
from lenses.cli import main
from lenses.table import format_table

PROMPT = "def add(a, b):\n    return a + b"
COLUMNS = ["layer", "position", "input_token", "top_token", "top_token_id", "top_prob", "entropy", "kl_to_final"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_csv_and_html(tiny_folder, tmp_path, capsys):
    csv, html_out = tmp_path / "x.csv", tmp_path / "x.html"
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--top-k", "3", "--csv", str(csv), "--out", str(html_out)]) == 0
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
    assert html_out.read_text().lower().startswith("<!doctype html>") and html_out.stat().st_size > 1_000_000


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
    assert "no such folder or file, and not a lens kind" in capsys.readouterr().err
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


# ------------------------------------------------------------------ figures for long prompts
def long_prompt(model, n: int) -> str:
    """The first `n` tokens of a standard-library module, as text."""
    import sysconfig

    text = open(sysconfig.get_paths()["stdlib"] + "/base64.py", encoding="utf-8").read()
    return model.tokenizer.decode(model.tokenizer.encode(text)[:n])


def captured_figure(monkeypatch) -> list:
    """Make `lenses.plots.save_figure` also hand the figure it writes to the returned list."""
    from lenses import plots

    seen, save = [], plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, **kw: (seen.append(fig), save(fig, path, **kw))[1])
    return seen


def assert_labels_fit(fig, n_positions: int) -> None:
    """Unrotated tick labels and cell text whose monospace width (0.6 em a character) fits one column."""
    from lenses.plots.style import MONO_EM

    layout = fig.layout
    plot_width = layout.width - layout.margin.l - layout.margin.r - 60  # 60 px or more go to the colour bar
    cell = plot_width / n_positions
    for axis in (layout.xaxis, layout.xaxis2):
        assert axis.tickangle == 0
        lines = [line for label in axis.ticktext for line in label.split("<br>")]
        longest = max(len(html.unescape(line)) for line in lines)
        assert axis.tickfont.size >= 8, axis.tickfont.size  # 8 px at scale 2 is 16 px in the PNG
        assert longest * MONO_EM * axis.tickfont.size <= cell, (longest, axis.tickfont.size, cell)
    heat = fig.data[0]
    if heat.texttemplate:
        longest = max(len(html.unescape(t)) for row in heat.text for t in row)
        assert 8 <= heat.textfont.size and longest * MONO_EM * heat.textfont.size <= cell


@pytest.mark.slow
def test_long_prompt_last_40_makes_a_readable_png(default_model, default_model_path, tmp_path, monkeypatch):
    prompt = long_prompt(default_model, 200)
    n = default_model.to_tokens(prompt).shape[1]
    assert n >= 195
    figures = captured_figure(monkeypatch)
    png = tmp_path / "long.png"
    assert main(["lens", prompt, "--last", "40", "--out", str(png)]) == 0
    fig = figures[0]
    assert list(fig.data[0].x) == list(range(n - 40, n))
    assert fig.layout.width <= 1100  # fits a notebook and a screen, however long the prompt
    assert_labels_fit(fig, 40)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == 2 * fig.layout.width


@pytest.mark.parametrize("size, inches", [("column", 3.3), ("page", 7.0)])
def test_size_presets_window_layers_and_title(tiny_folder, tmp_path, monkeypatch, size, inches):
    figures = captured_figure(monkeypatch)
    html_out = tmp_path / "x.html"
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--out", str(html_out), "--size", size,
                 "--positions", "2:6", "--layers", "0,2", "--title", "My lens"]) == 0
    fig = figures[0]
    assert fig.layout.width == round(inches * 96) and fig.layout.title.text == "My lens"
    assert list(fig.data[0].x) == [2, 3, 4, 5] and list(fig.data[0].y) == [0, 2]
    assert list(fig.layout.yaxis.ticktext) == ["emb", "2"]
    assert fig.layout.meta["export_scale"] == pytest.approx(300 / 96)  # 300 dpi in a PNG
    assert_labels_fit(fig, 4)
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--out", str(html_out), "--width", "500", "--height", "260"]) == 0
    small, wide = figures[1].layout, None
    assert (small.width, small.height) == (500, 260)
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--out", str(html_out), "--width", "1000", "--height", "500"]) == 0
    wide = figures[2].layout
    assert wide.font.size > small.font.size  # fonts follow the size


def test_figure_option_errors(tiny_folder, tmp_path, capsys):
    out = str(tmp_path / "x.html")
    with pytest.raises(SystemExit):
        main(["lens", PROMPT, "--model", str(tiny_folder), "--out", out, "--positions", "7"])
    assert "START:STOP" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["lens", PROMPT, "--model", str(tiny_folder), "--out", out, "--positions", "1:3", "--last", "4"])
    assert "not allowed with" in capsys.readouterr().err
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--out", out, "--layers", "0,9"]) == 2
    assert "layers [9] are not in the trajectory" in capsys.readouterr().err
    assert main(["lens", PROMPT, "--model", str(tiny_folder), "--out", out, "--positions", "50:60"]) == 2
    assert "select nothing" in capsys.readouterr().err


def test_a_static_export_starts_the_browser_once(tiny_folder, tmp_path, monkeypatch):
    """`lenskit lens --out x.png` draws the figure once, after one 100 px probe made before the work (so a missing
    browser fails first, issue 29), both in the one browser the process starts (each is a Chromium)."""
    from lenses.plots import export

    calls = {"calc": 0, "browsers": 0}

    class Browser:
        pid = os.getpid()

        def __init__(self):
            calls["browsers"] += 1

        def render(self, fig, opts):
            calls["calc"] += 1
            return b"\x89PNG\r\n\x1a\n" + b"\0" * 16

        def close(self):
            pass

    export.stop_export_browser()
    monkeypatch.setattr(export, "_Browser", Browser)
    try:
        assert main(["lens", PROMPT, "--model", str(tiny_folder), "--out", str(tmp_path / "x.png")]) == 0
    finally:
        export.stop_export_browser()
    assert calls == {"calc": 2, "browsers": 1}, calls  # the probe, then the figure
    assert (tmp_path / "x.png").read_bytes().startswith(b"\x89PNG")

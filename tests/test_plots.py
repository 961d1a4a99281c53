"""Figures hold the numbers they are given; export writes real HTML/PNG/SVG/PDF files offline."""

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from lenses import LogitLens, Trajectory, metrics, plots
from tiny_tokenizer import make_model_with_tokenizer


@pytest.fixture(scope="module")
def traj():
    model = make_model_with_tokenizer()
    return Trajectory.from_prompt(model, LogitLens(model), ["def add(a, b):\n    return a + b", "import os"], top_k=3)


def test_display_token():
    assert plots.display_token("    return") == "····return"
    assert plots.display_token("\n\t") == "\\n\\t"
    assert plots.display_token("a<b>") == "a&lt;b&gt;"  # plotly would read a tag
    assert plots.display_token("\x0c") == "\\x0c"  # control characters break static export
    assert plots.display_token("") == "∅"
    assert plots.display_token("abcdefghij", max_chars=5) == "abcd…"


@pytest.mark.parametrize("color", ["prob", "entropy", "kl", "rank"])
def test_heatmap_cells_hold_the_trajectory(traj, color):
    df = traj.to_frame()
    fig = plots.logit_lens_heatmap(traj, color=color, batch=0)
    assert isinstance(fig, go.Figure)
    heat = fig.data[0]
    one = df[df.batch == 0]
    n_pos = one.position.nunique()
    assert list(heat.y) == list(range(traj.n_layers + 1)) and list(heat.x) == list(range(n_pos))
    column = plots.HEATMAP_COLORS[color][0]
    want = one.pivot(index="layer", columns="position", values=column).to_numpy(dtype=float)
    if color == "rank":
        want = np.log10(np.where(want >= 0, want, np.nan) + 1)
    if color == "kl":  # log scale, floored at KL_FLOOR nats
        want = np.log10(np.maximum(want, plots.KL_FLOOR))
    np.testing.assert_allclose(np.asarray(heat.z, dtype=float), want, equal_nan=True)
    # cell text is the top-1 token, hover lists the top-k with probabilities
    l, p = 2, 3
    row = one[(one.layer == l) & (one.position == p)].iloc[0]
    assert heat.text[l][p] == plots.display_token(row.top_token, 6)
    hover = heat.customdata[l][p]
    for i in (1, 2, 3):
        assert f"{i}. {plots.display_token(row[f'top{i}_token'])}  {row[f'top{i}_prob']:.3f}" in hover
    # bottom axis: input tokens; top axis: the next token each position predicts
    assert list(fig.layout.xaxis.ticktext) == [plots.display_token(t, 6) for t in one[one.layer == 0].input_token]
    assert list(fig.layout.xaxis2.ticktext)[:-1] == list(fig.layout.xaxis.ticktext)[1:]


def test_heatmap_selects_batch_and_checks_input(traj):
    fig = plots.logit_lens_heatmap(traj.to_frame(), batch=1)
    assert len(fig.data[0].x) == len(traj.tokenizer.encode("import os"))
    with pytest.raises(ValueError, match="batch=5"):
        plots.logit_lens_heatmap(traj, batch=5)
    with pytest.raises(ValueError, match="color"):
        plots.logit_lens_heatmap(traj, color="loss")
    with pytest.raises(KeyError, match="lacks columns"):
        plots.logit_lens_heatmap(pd.DataFrame({"layer": [0], "position": [0]}))


def test_layer_curves_draw_mean_and_ci():
    rng = np.random.default_rng(0)
    rows = [dict(lens=lens, layer=l, prompt=p, kl=rng.normal(l * (1 if lens == "logit" else 0.5), 1.0))
            for lens in ("logit", "tuned") for l in range(4) for p in range(10)]
    df = pd.DataFrame(rows)
    fig = plots.layer_curves(df, "kl", series="lens", unit="prompt", ylabel="KL (nats)")
    summary = metrics.mean_ci(df, "kl", by=["lens", "layer"], unit="prompt")
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    bands = [t for t in fig.data if t.fill == "toself"]
    assert [t.name for t in lines] == ["logit", "tuned"] and len(bands) == 2
    tuned = summary[summary.lens == "tuned"].sort_values("layer")
    np.testing.assert_allclose(lines[1].y, tuned["mean"])
    np.testing.assert_allclose(bands[1].y, np.concatenate([tuned["hi"], tuned["lo"][::-1]]))
    assert lines[0].line.color != lines[1].line.color
    # an already summarised frame is drawn as given
    again = plots.layer_curves(summary, series="lens")
    np.testing.assert_allclose([t for t in again.data if t.mode == "lines+markers"][0].y, summary[summary.lens == "logit"]["mean"])


def test_save_html_and_bad_suffix(tmp_path, traj):
    fig = plots.logit_lens_heatmap(traj)
    out = plots.save_figure(fig, tmp_path / "sub" / "lens.html")
    text = out.read_text()
    assert text.lower().startswith("<!doctype html>") and "plotly.js v" in text  # plotly.js inlined: opens offline
    assert len(text) > 1_000_000 and 'src="http' not in text
    with pytest.raises(ValueError, match=r"\.html, \.png"):
        plots.save_figure(fig, tmp_path / "lens.jpeg")


def test_missing_browser_gives_clear_error(tmp_path, traj, monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-chrome"))
    with pytest.raises(RuntimeError, match="BROWSER_PATH"):
        plots.save_figure(plots.logit_lens_heatmap(traj), tmp_path / "lens.png")


@pytest.mark.slow
def test_static_export_writes_real_files(tmp_path, traj):
    fig = plots.logit_lens_heatmap(traj, title="logit lens")
    with plots.export_session():  # one Chrome for all three
        png = plots.save_figure(fig, tmp_path / "lens.png")
        svg = plots.save_figure(fig, tmp_path / "lens.svg")
        pdf = plots.save_figure(fig, tmp_path / "lens.pdf", width=600, height=300)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(png.read_bytes()[16:20], "big"), int.from_bytes(png.read_bytes()[20:24], "big")
    assert (w, h) == (2 * fig.layout.width, 2 * fig.layout.height)  # scale 2 by default
    assert svg.read_text().lstrip().startswith("<svg") and "·add" in svg.read_text()
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5_000


def test_save_figures_writes_every_name_and_format(tmp_path):
    import plotly.graph_objects as go

    figs = {"a": go.Figure(go.Scatter(x=[0, 1], y=[1, 0])), "b": go.Figure(go.Bar(x=[1], y=[2]))}
    paths = plots.save_figures(figs, tmp_path, "png, svg,html")
    assert sorted(p.name for p in paths) == ["a.html", "a.png", "a.svg", "b.html", "b.png", "b.svg"]
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "b.svg").read_bytes()[:400]
    assert plots.save_figures(figs, tmp_path / "h", ["html"]) == [tmp_path / "h" / "a.html", tmp_path / "h" / "b.html"]

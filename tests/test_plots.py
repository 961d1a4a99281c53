"""Figures hold the numbers they are given; export writes real HTML/PNG/SVG/PDF files offline."""

import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from tiny_tokenizer import make_model_with_tokenizer

from lenses import LogitLens, Trajectory, metrics, plots
from lenses.plots.export import stop_export_browser


@pytest.fixture(scope="module")
def traj():
    model = make_model_with_tokenizer()
    return Trajectory.from_prompt(LogitLens(model), ["def add(a, b):\n    return a + b", "import os"], top_k=3)


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
    stop_export_browser()  # a browser an earlier test of this process started would be reused, whatever BROWSER_PATH says
    with pytest.raises(RuntimeError, match="BROWSER_PATH"):
        plots.save_figure(plots.logit_lens_heatmap(traj), tmp_path / "lens.png")


@pytest.mark.slow
def test_static_export_writes_real_files(tmp_path, traj):
    fig = plots.logit_lens_heatmap(traj, title="logit lens")
    with plots.export_session():  # one Chrome for all three
        png = plots.save_figure(fig, tmp_path / "lens.png")
        svg = plots.save_figure(fig, tmp_path / "lens.svg")
        pdf = plots.save_figure(fig, tmp_path / "lens.pdf", width=600, height=300)
        column = plots.save_figure(plots.logit_lens_heatmap(traj, size="column"), tmp_path / "column.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(png.read_bytes()[16:20], "big"), int.from_bytes(png.read_bytes()[20:24], "big")
    assert (w, h) == (2 * fig.layout.width, 2 * fig.layout.height)  # scale 2 unless sized by a preset
    assert svg.read_text().lstrip().startswith("<svg") and "·add" in svg.read_text()
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5_000
    assert pdf_title(pdf.read_bytes()) == "logit lens"  # not Chrome's "Kaleido-fier"
    # a column-wide figure is 3.3 in at 300 dpi
    assert abs(int.from_bytes(column.read_bytes()[16:20], "big") - 3.3 * 300) <= 2


def pdf_title(pdf: bytes) -> str:
    """The /Title of the info dictionary that the last trailer names, checking the offsets on the way:
    `startxref` must point at an xref table whose entry for that object points at the object."""
    start = int(re.findall(rb"startxref\s+(\d+)\s+%%EOF", pdf)[-1])
    assert pdf[start:start + 4] == b"xref"
    table = pdf[start:pdf.index(b"trailer", start)]
    info = re.search(rb"/Info\s+(\d+)\s+(\d+)\s+R", pdf[pdf.index(b"trailer", start):])
    number = int(info.group(1))
    offset = None
    for first, count, rows in re.findall(rb"(\d+) (\d+)\n((?:\d{10} \d{5} [nf] \n)+)", table):
        if int(first) <= number < int(first) + int(count):
            row = rows[20 * (number - int(first)):20 * (number - int(first) + 1)]
            offset = int(row[:10])
    assert offset is not None and pdf[offset:].startswith(f"{number} ".encode())
    obj = pdf[offset:pdf.index(b"endobj", offset)]
    hex_title = re.search(rb"/Title\s*<([0-9A-Fa-f]+)>", obj)
    if hex_title:
        return bytes.fromhex(hex_title.group(1).decode())[2:].decode("utf-16-be")
    return re.search(rb"/Title\s*\((.*?)\)", obj).group(1).decode("latin-1")


def test_set_pdf_title_appends_an_update_and_changes_nothing_before():
    from lenses.plots.export import set_pdf_title

    body = (b"%PDF-1.4\n1 0 obj\n<</Title (Kaleido-fier)>>\nendobj\n2 0 obj\n<</Type /Catalog>>\nendobj\n")
    xref_at = len(body)
    original = body + (b"xref\n0 3\n0000000000 65535 f \n0000000009 00000 n \n%010d 00000 n \n" % body.index(b"2 0 obj")
                       + b"trailer\n<</Size 3\n/Root 2 0 R\n/Info 1 0 R>>\nstartxref\n%d\n%%%%EOF\n" % xref_at)
    assert pdf_title(original) == "Kaleido-fier"
    updated = set_pdf_title(original, "KL by layer – ü")
    assert updated.startswith(original) and pdf_title(updated) == "KL by layer – ü"
    assert b"/Prev %d" % xref_at in updated and b"/Root 2 0 R" in updated.split(b"trailer")[-1]
    assert set_pdf_title(b"not a pdf", "x") == b"not a pdf"  # anything else is left alone
    assert plots.figure_title(go.Figure().update_layout(title="KL<br>by &amp; layer")) == "KL by & layer"


def test_html_inlines_plotly_by_default_or_loads_it_from_a_cdn(tmp_path):
    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 0]))
    inline = plots.save_figure(fig, tmp_path / "inline.html").stat().st_size
    cdn = plots.save_figure(fig, tmp_path / "cdn.html", plotlyjs="cdn")
    assert inline > 3_000_000 and cdn.stat().st_size < 50_000 and 'src="https://cdn.plot.ly/' in cdn.read_text()
    with pytest.raises(ValueError, match="inline"):
        plots.save_figure(fig, tmp_path / "x.html", plotlyjs="local")


def test_heatmap_colour_scales_resist_outliers(traj):
    df = traj.to_frame()
    one = df[df.batch == 0].copy()
    one.loc[one.layer == 0, "kl_to_final"] = 25.0  # the embeddings far off, as in real models
    fig = plots.logit_lens_heatmap(one, color="kl")
    bar = fig.data[0].colorbar
    assert fig.data[0].zmin == pytest.approx(np.log10(plots.KL_FLOOR)) and fig.data[0].zmax == pytest.approx(np.log10(25.0))
    assert bar.ticktext[0] == "≤0.01" and "10" in bar.ticktext
    one.loc[(one.layer == 1) & (one.position == 0), "entropy"] = 1e3  # one outlier
    heat = plots.logit_lens_heatmap(one, color="entropy", clip=95).data[0]
    assert heat.zmax == pytest.approx(np.nanpercentile(heat.z, 95)) and "clipped at p95" in heat.colorbar.title.text
    assert "clipped" not in plots.logit_lens_heatmap(traj, color="prob").data[0].colorbar.title.text


def test_heatmap_window_and_layer_selection(traj):
    fig = plots.logit_lens_heatmap(traj, last=3, layers=[0, 3])
    n = traj.to_frame().query("batch == 0").position.nunique()
    assert list(fig.data[0].x) == [n - 3, n - 2, n - 1] and list(fig.data[0].y) == [0, 3]
    assert list(fig.layout.yaxis.ticktext) == ["emb", "3"] and "layer 0 (embeddings)" in fig.data[0].customdata[0][0]
    assert list(plots.logit_lens_heatmap(traj, positions=slice(1, 3)).data[0].x) == [1, 2]
    assert list(plots.logit_lens_heatmap(traj, positions=[0, 4]).data[0].x) == [0, 4]
    with pytest.raises(ValueError, match="not both"):
        plots.logit_lens_heatmap(traj, positions=slice(0, 2), last=2)
    with pytest.raises(ValueError, match="size='poster'"):
        plots.logit_lens_heatmap(traj, size="poster")


def test_long_tokens_are_cut_on_one_line_without_rotation():
    labels, size = plots.token_labels(["    return", "a", "\n\n"], cell_px=30, font=14, max_chars=12)
    assert size == 8 and not any("<br>" in label for label in labels) and labels[1] == "a"
    assert labels[0].endswith("…") and "····return".startswith(labels[0][:-1])
    roomy, big = plots.token_labels(["    return"], cell_px=200, font=14, max_chars=12)
    assert roomy == ["····return"] and big == 14


def test_figure_fonts_follow_the_size(traj):
    column = plots.logit_lens_heatmap(traj, size="column").layout
    page = plots.logit_lens_heatmap(traj, size="page").layout
    assert (column.width, page.width) == (round(3.3 * 96), round(7 * 96))
    assert column.font.size < page.font.size and column.margin.l < page.margin.l


def test_log_y_curves_leave_out_exact_zeros():
    summary = pd.DataFrame({"layer": [0, 1, 2], "mean": [5.0, 0.5, 0.0], "lo": [4.0, -0.1, 0.0], "hi": [6.0, 1.0, 0.0]})
    fig = plots.layer_curves(summary, log_y=True)
    line = [t for t in fig.data if t.mode == "lines+markers"][0]
    assert list(line.x) == [0, 1] and all(v > 0 for t in fig.data for v in t.y)
    assert list(fig.layout.xaxis.ticktext) == ["emb", "1"]


def test_difference_heatmap_keeps_labels_flat_and_its_title_inside():
    rows = [dict(layer=l, position=p, input_token=f"tok{p}", clean_top_token="a", ablated_top_token="b", clean_top_prob=0.5,
                 ablated_top_prob=0.4, kl=0.1 * l, delta_target_prob=-0.1 * l) for l in range(4) for p in range(20)]
    fig = plots.difference_heatmap(pd.DataFrame(rows), size="page", last=10)
    assert fig.layout.xaxis.tickangle == 0 and fig.layout.xaxis.automargin and list(fig.data[0].x) == list(range(10, 20))
    assert fig.layout.width == round(7 * 96)


def test_save_figures_writes_every_name_and_format(tmp_path):
    import plotly.graph_objects as go

    figs = {"a": go.Figure(go.Scatter(x=[0, 1], y=[1, 0])), "b": go.Figure(go.Bar(x=[1], y=[2]))}
    paths = plots.save_figures(figs, tmp_path, "png, svg,html")
    assert sorted(p.name for p in paths) == ["a.html", "a.png", "a.svg", "b.html", "b.png", "b.svg"]
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "b.svg").read_bytes()[:400]
    assert plots.save_figures(figs, tmp_path / "h", ["html"]) == [tmp_path / "h" / "a.html", tmp_path / "h" / "b.html"]

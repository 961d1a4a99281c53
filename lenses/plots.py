"""Figures for papers and notebooks. The only module that imports plotly; every function returns a `go.Figure`.

Statistics are computed elsewhere (`Trajectory`, `metrics.mean_ci`); functions here only draw.
Sections: style, export, logit-lens heatmap, per-layer curves. Add new figure kinds as new sections.
"""

from __future__ import annotations

import html
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from . import metrics
from .trajectory import show_token

# =================================================================== style
FONT = "Liberation Sans, Arial, Helvetica, DejaVu Sans, sans-serif"
MONO = "DejaVu Sans Mono, Liberation Mono, Menlo, Consolas, monospace"
# Okabe & Ito's colour-blind-safe palette, black first for a single series.
COLORS = ["#000000", "#E69F00", "#0072B2", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442"]

_axis = dict(showline=True, linecolor="black", linewidth=1, ticks="outside", tickcolor="black", mirror=False,
             showgrid=False, zeroline=False, title_standoff=8)
PAPER = go.layout.Template(layout=go.Layout(
    font=dict(family=FONT, size=14, color="black"),
    paper_bgcolor="white", plot_bgcolor="white", colorway=COLORS,
    xaxis=_axis, yaxis=_axis,
    legend=dict(bgcolor="rgba(255,255,255,0.8)", borderwidth=0),
    margin=dict(l=70, r=20, t=40, b=60),
    hoverlabel=dict(font=dict(family=MONO, size=12)),
))
"""White background, black axis lines, no grid, 14 pt sans-serif: reads well at a column's width."""


def display_token(text: str, max_chars: int | None = None) -> str:
    """`trajectory.show_token` (visible whitespace, escaped control characters), HTML-escaped for plotly.

    Control characters must go: they would also make the SVG that static export rasterises invalid XML.
    """
    return html.escape(show_token(text, max_chars), quote=False)  # plotly reads '<' as the start of a tag


# ================================================================== export
STATIC_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
EXPORT_TIMEOUT_S = 600


def save_figure(fig: go.Figure, path: str | os.PathLike, *, width: int | None = None, height: int | None = None,
                scale: float | None = None) -> Path:
    """Write `fig` by the path's suffix: .html (self-contained, plotly.js inlined, opens offline), .png, .svg, .pdf.

    Static formats are drawn by kaleido 1.x in a headless Chrome/Chromium (Debian's `chromium` package,
    which scripts/install.sh installs; set BROWSER_PATH to use another). MathJax is switched off, so
    nothing is fetched from the network. PNGs default to scale 2 (print resolution).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".html", *STATIC_FORMATS):
        raise ValueError(f"cannot tell the format of {str(path)!r}: expected a name ending in .html, .png, .svg or .pdf")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".html":
        fig.write_html(path, include_plotlyjs=True, full_html=True, config={"displaylogo": False})
        return path
    path.write_bytes(_render_static(fig, STATIC_FORMATS[suffix], width, height, scale))
    return path


_sessions = 0


@contextmanager
def export_session() -> Iterator[None]:
    """Reuse one headless Chrome for every static export in the block (otherwise each export starts its own).

    >>> with export_session():
    ...     for suffix in (".png", ".svg", ".pdf"):
    ...         save_figure(fig, "figures/lens" + suffix)
    """
    import kaleido
    from kaleido.errors import ChromeNotFoundError

    global _sessions
    if _sessions == 0:
        try:
            kaleido.start_sync_server(mathjax=False, timeout=EXPORT_TIMEOUT_S, silence_warnings=True)
        except ChromeNotFoundError:
            raise RuntimeError(_no_chrome_message("static export")) from None
    _sessions += 1
    try:
        yield
    finally:
        _sessions -= 1
        if _sessions == 0:
            kaleido.stop_sync_server(silence_warnings=True)


def _no_chrome_message(what: str) -> str:
    hint = f" (BROWSER_PATH={os.environ['BROWSER_PATH']!r} is set; is it an executable Chrome?)" if "BROWSER_PATH" in os.environ else ""
    return (f"{what} needs Chrome or Chromium, and none was found{hint}. Install one (`apt-get install chromium`, "
            "as scripts/install.sh does) or point BROWSER_PATH at it; or save as .html, which needs no browser.")


def check_static_export() -> None:
    """Render a one-point figure to PNG; raise RuntimeError saying what is missing if that fails."""
    png = _render_static(go.Figure(go.Scatter(x=[0], y=[0])), "png", 100, 100, 1)
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise RuntimeError(f"static export returned {len(png)} bytes that are not a PNG")
    print("static figure export works (kaleido + headless Chrome)")


def _render_static(fig: go.Figure, fmt: str, width: int | None, height: int | None, scale: float | None) -> bytes:
    import kaleido
    from kaleido.errors import ChromeNotFoundError

    layout = fig.layout
    opts = dict(format=fmt, width=width or layout.width or 900, height=height or layout.height or 500,
                scale=scale or (2 if fmt == "png" else 1))
    try:
        # mathjax=False: kaleido otherwise loads MathJax from a CDN, which hangs or fails offline.
        # timeout: seconds per image; kaleido's default of 90 is too short on a busy 2-core CI machine.
        kopts = None if _sessions else dict(mathjax=False, timeout=EXPORT_TIMEOUT_S)  # a session was started with these
        return kaleido.calc_fig_sync(fig.to_dict(), opts=opts, kopts=kopts)
    except ChromeNotFoundError:
        raise RuntimeError(_no_chrome_message(f"exporting {fmt.upper()}")) from None


# ===================================================== logit-lens heatmap
HEATMAP_COLORS = {
    # color= -> (column, colour-bar title, colorscale, reversed?) ; dark always means "confident / close to the output"
    "prob": ("top_prob", "top-1 prob", "Blues", False),
    "entropy": ("entropy", "entropy (nats)", "Blues", True),
    "kl": ("kl_to_final", "KL(final ‖ lens)<br>(nats)", "Blues", True),
    "rank": ("target_rank", "target rank<br>(0 = top-1)", "Blues", True),
}


def _as_frame(data: Any, batch: int) -> pd.DataFrame:
    frame = data.to_frame() if hasattr(data, "to_frame") else data
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"expected a Trajectory or its to_frame() DataFrame, got {type(data).__name__}")
    if "batch" in frame.columns:
        if batch not in set(frame["batch"]):
            raise ValueError(f"batch={batch} is not in this trajectory; it holds sequences {sorted(set(frame['batch']))}")
        frame = frame[frame["batch"] == batch]
    return frame


HEATMAP_CELL = (72, 44)  # px per position and per layer: room for 6 characters of 16 px monospace


def logit_lens_heatmap(data: Any, color: str = "prob", *, batch: int = 0, title: str | None = None,
                       cell_text: bool | None = None, max_chars: int = 6) -> go.Figure:
    """Layers (rows, stream 0 at the bottom) by positions (columns), each cell the lens's top-1 token.

    `data` is a `Trajectory` or its `to_frame()`. `color` is one of 'prob' (top-1 probability),
    'entropy', 'kl' (KL(final || lens), nats) or 'rank' (of the target token, log scale). The bottom
    axis shows the input tokens, the top axis the target each position should predict. Hover shows
    the top-k with probabilities. Cell text is on unless there are more than 40 positions.

    >>> fig = logit_lens_heatmap(Trajectory.from_prompt(model, LogitLens(model), "import os"), color="entropy")
    """
    if color not in HEATMAP_COLORS:
        raise ValueError(f"color={color!r} is not one of {sorted(HEATMAP_COLORS)}")
    column, cbar_title, scale, reverse = HEATMAP_COLORS[color]
    frame = _as_frame(data, batch)
    needed = ["layer", "position", "input_token", "top_token", column]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise KeyError(f"the frame lacks columns {missing}; pass Trajectory.to_frame() output")
    layers = np.sort(frame["layer"].unique())
    positions = np.sort(frame["position"].unique())
    grid = frame.pivot(index="layer", columns="position", values=column).reindex(index=layers, columns=positions)
    z = grid.to_numpy(dtype=float)
    colorbar: dict[str, Any] = dict(title=dict(text=cbar_title, side="right"), thickness=14, outlinewidth=0, ticks="outside")
    zmin, zmax = None, None
    if color == "prob":
        zmin, zmax = 0.0, 1.0
    if color == "rank":
        z = np.log10(np.where(z >= 0, z, np.nan) + 1)  # rank 0 -> 0; no target -> blank
        top = max(1, math.ceil(np.nanmax(z)) if np.isfinite(z).any() else 1)
        ranks = [0] + [10 ** k for k in range(1, top + 1)]
        colorbar |= dict(tickvals=[math.log10(r + 1) for r in ranks], ticktext=[f"{r:,}" for r in ranks])
        zmin, zmax = 0.0, float(top)

    top_text = frame.pivot(index="layer", columns="position", values="top_token").reindex(index=layers, columns=positions)
    text = [[display_token(str(t), max_chars) for t in row] for row in top_text.to_numpy()]
    hover = _heatmap_hover(frame, layers, positions)
    if cell_text is None:
        cell_text = len(positions) <= 40
    inputs = frame[frame["layer"] == layers[0]].set_index("position").reindex(positions)

    fig = go.Figure(go.Heatmap(
        z=z, x=positions, y=layers, colorscale=scale, reversescale=reverse, zmin=zmin, zmax=zmax,
        text=text, texttemplate="%{text}" if cell_text else None, textfont=dict(family=MONO, size=16),
        customdata=hover, hovertemplate="%{customdata}<extra></extra>", colorbar=colorbar, xgap=1, ygap=1,
    ))
    xticks = [display_token(str(t), max_chars) for t in inputs["input_token"]]
    n_pos, n_layers = len(positions), len(layers)
    # Both x axes get the same fixed range (`matches` with `overlaying` breaks plotly.js's static export).
    xrange = [float(positions[0]) - 0.5, float(positions[-1]) + 0.5]
    cell_w, cell_h = HEATMAP_CELL
    # Labels stay horizontal while the longest fits its column (16 px monospace is ~9.6 px a character).
    angle = 0 if max(len(html.unescape(t)) for t in xticks) * 9.6 <= cell_w - 6 else -45
    fig.update_layout(
        template=PAPER, title=dict(text=title, x=0.0, xref="paper", xanchor="left", font=dict(size=20)) if title else None,
        width=int(min(3000, 170 + cell_w * n_pos)), height=int(min(1600, (210 if angle else 170) + cell_h * n_layers)),
        margin=dict(l=70, r=20, t=(110 if angle else 80) if title else (80 if angle else 50), b=80 if angle else 60),
        font=dict(size=18),
        xaxis=dict(title=dict(text="input token"), range=xrange, tickmode="array", tickvals=positions, ticktext=xticks,
                   tickfont=dict(family=MONO, size=16), tickangle=angle, showline=False, ticks=""),
        yaxis=dict(title=dict(text="layer"), tickmode="array", tickvals=layers, dtick=1, showline=False, ticks="",
                   tickfont=dict(size=16), ticklabelstandoff=6),
    )
    if "target_token" in frame.columns:
        targets = ["" if t is None or (isinstance(t, float) and np.isnan(t)) else display_token(str(t), max_chars)
                   for t in inputs["target_token"]]
        # An invisible trace on a second x axis carries the "next token" labels along the top.
        fig.add_trace(go.Scatter(x=positions, y=[layers[0]] * n_pos, xaxis="x2", mode="markers",
                                 marker=dict(opacity=0), hoverinfo="skip", showlegend=False))
        fig.update_layout(xaxis2=dict(overlaying="x", side="top", range=xrange, tickmode="array", tickvals=positions,
                                      ticktext=targets, tickfont=dict(family=MONO, size=16, color="#555555"),
                                      tickangle=angle, showline=False, ticks="", showgrid=False,
                                      title=dict(text="next token", font=dict(color="#555555", size=16), standoff=4)))
    return fig


def _heatmap_hover(frame: pd.DataFrame, layers: np.ndarray, positions: np.ndarray) -> list[list[str]]:
    k = 1
    while f"top{k + 1}_token" in frame.columns:
        k += 1
    lines = pd.Series("layer " + frame["layer"].astype(str) + ", position " + frame["position"].astype(str)
                      + "<br>input: " + frame["input_token"].map(lambda t: display_token(str(t))), index=frame.index)
    if "target_rank" in frame.columns:
        has = frame["target_rank"] >= 0
        tgt = ("<br>target " + frame["target_token"].map(lambda t: display_token(str(t))) + ": rank "
               + frame["target_rank"].astype(str) + ", p=" + frame["target_prob"].map(lambda p: f"{p:.3f}"))
        lines = lines + tgt.where(has, "")
    lines = lines + "<br>entropy " + frame["entropy"].map(lambda v: f"{v:.2f}") + " nats, KL "
    lines = lines + frame["kl_to_final"].map(lambda v: f"{v:.2f}") + " nats"
    if "top1_token" in frame.columns:
        for i in range(1, k + 1):
            lines = (lines + f"<br>{i}. " + frame[f"top{i}_token"].map(lambda t: display_token(str(t)))
                     + "  " + frame[f"top{i}_prob"].map(lambda p: f"{p:.3f}"))
    hover = pd.DataFrame({"layer": frame["layer"], "position": frame["position"], "h": lines})
    return hover.pivot(index="layer", columns="position", values="h").reindex(index=layers, columns=positions).fillna("").to_numpy().tolist()


# ======================================================= per-layer curves
def layer_curves(data: pd.DataFrame, y: str = "kl_to_final", *, series: str | None = None, x: str = "layer",
                 unit: str | None = None, ylabel: str | None = None, title: str | None = None,
                 log_y: bool = False) -> go.Figure:
    """Mean of `y` per layer with a shaded 95% confidence band, one line per value of `series` (e.g. 'lens').

    `data` is either raw rows (e.g. several trajectories' frames concatenated with a 'lens' and a
    'prompt' column), summarised here with `metrics.mean_ci(data, y, by=[series, x], unit=unit)`, or
    an already summarised frame with columns `x, mean, lo, hi` (plus `series`).

    >>> layer_curves(pd.concat([logit_df, tuned_df]), "kl_to_final", series="lens", unit="prompt")
    """
    keys = [series, x] if series else [x]
    summary = data if {"mean", "lo", "hi"} <= set(data.columns) else metrics.mean_ci(data, y, by=keys, unit=unit)
    groups: Sequence[tuple[Any, pd.DataFrame]] = list(summary.groupby(series, sort=False)) if series else [(None, summary)]
    fig = go.Figure()
    for i, (name, g) in enumerate(groups):
        g = g.sort_values(x)
        c = COLORS[i % len(COLORS)]
        band = g.dropna(subset=["lo", "hi"])
        if len(band):
            fig.add_trace(go.Scatter(
                x=np.concatenate([band[x], band[x][::-1]]), y=np.concatenate([band["hi"], band["lo"][::-1]]),
                fill="toself", fillcolor=_rgba(c, 0.18), line=dict(width=0), mode="lines", hoverinfo="skip",
                showlegend=False, legendgroup=str(name),
            ))
        fig.add_trace(go.Scatter(
            x=g[x], y=g["mean"], mode="lines+markers", name=str(name) if name is not None else y,
            line=dict(color=c, width=2), marker=dict(size=6), legendgroup=str(name),
            hovertemplate=f"{x} %{{x}}<br>mean %{{y:.3f}}<extra>{name if name is not None else ''}</extra>",
        ))
    fig.update_layout(
        template=PAPER, width=600, height=400, showlegend=series is not None,
        title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
        xaxis=dict(title=dict(text=x), dtick=1), yaxis=dict(title=dict(text=ylabel or y), type="log" if log_y else None),
        legend=dict(x=0.98, xanchor="right", y=0.98, yanchor="top"),
    )
    return fig


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


# ================================================= residual-stream anatomy
def resid_norm_curves(norms: pd.DataFrame, y: str = "rms", *, title: str | None = None, log_y: bool = False) -> go.Figure:
    """Stream and write sizes by layer from `anatomy.resid_norms`: mean over sequences, 95% bands.

    A write of block l is drawn at l + 0.5, between the stream it reads (l) and the one it lands in (l + 1).
    """
    frame = norms.assign(layer=norms["layer"] + np.where(norms["component"] == "resid", 0.0, 0.5))
    label = {"rms": "RMS per entry", "mean_norm": "L2 norm"}.get(y, y)
    fig = layer_curves(frame, y, series="component", unit="batch", ylabel=label, title=title, log_y=log_y)
    fig.update_layout(width=700, legend=dict(x=1.02, xanchor="left", y=1.0, yanchor="top"))
    if log_y:
        fig.update_yaxes(**_log_ticks(frame[y]))
    return fig


def attribution_bars(dla: pd.DataFrame, *, batch: int = 0, title: str | None = None) -> go.Figure:
    """Each part's direct logit attribution (`anatomy.direct_logit_attribution`) as bars, first part on top."""
    frame = _as_frame(dla, batch)
    colors = np.where(frame["attribution"] >= 0, COLORS[2], COLORS[4])
    fig = go.Figure(go.Bar(x=frame["attribution"], y=frame["component"], orientation="h", marker_color=colors,
                           hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    left = 20 + 8 * int(frame["component"].str.len().max())  # room for the longest label in monospace
    fig.update_layout(template=PAPER, width=600, height=int(120 + 18 * len(frame)), margin=dict(l=left),
                      title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
                      xaxis=dict(title=dict(text="direct logit attribution"), zeroline=True, zerolinecolor="#888888"),
                      yaxis=dict(autorange="reversed", tickfont=dict(family=MONO, size=12), showline=False, ticks=""))
    return fig


def head_attribution_heatmap(dla: pd.DataFrame, *, batch: int = 0, title: str | None = None) -> go.Figure:
    """Layers (rows) by heads (columns), each cell one head's direct logit attribution; zero is white."""
    frame = _as_frame(dla, batch)
    heads = frame[frame["kind"] == "head"]
    if heads.empty:
        raise ValueError("no per-head rows; call direct_logit_attribution(..., per_head=True)")
    grid = heads.pivot(index="layer", columns="head", values="attribution").sort_index()
    bound = float(np.nanmax(np.abs(grid.to_numpy()))) or 1.0
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(dtype=float), x=grid.columns.astype(int), y=grid.index.astype(int),
                               colorscale="RdBu", zmid=0, zmin=-bound, zmax=bound, xgap=1, ygap=1,
                               texttemplate="%{z:.2g}",
                               colorbar=dict(title=dict(text="attribution", side="right"), thickness=14, outlinewidth=0),
                               hovertemplate="layer %{y}, head %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(template=PAPER, width=int(200 + 55 * grid.shape[1]), height=int(160 + 40 * grid.shape[0]),
                      title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
                      xaxis=dict(title=dict(text="head"), dtick=1, showline=False, ticks=""),
                      yaxis=dict(title=dict(text="layer"), dtick=1, showline=False, ticks=""))
    return fig


def growth_curves(frame: pd.DataFrame, y: str = "rms", *, group: str = "n_layers", style: str = "init",
                  unit: str = "seed", x: str = "layer", title: str | None = None, log_y: bool = True) -> go.Figure:
    """`y` by `x` for several models: colour per `group` value (e.g. depth), dash per `style` value
    (e.g. init), mean over `unit` (e.g. seeds) with 95% bands."""
    summary = metrics.mean_ci(frame, y, by=[style, group, x], unit=unit)
    fig = go.Figure()
    dashes = {s: d for s, d in zip(summary[style].unique(), ["solid", "dash", "dot", "dashdot"])}
    for i, ((s, g), part) in enumerate(summary.groupby([style, group], sort=False)):
        c = COLORS[list(summary[group].unique()).index(g) % len(COLORS)]
        band = part.dropna(subset=["lo", "hi"])
        if len(band):
            fig.add_trace(go.Scatter(x=np.concatenate([band[x], band[x][::-1]]),
                                     y=np.concatenate([band["hi"], band["lo"][::-1]]), fill="toself",
                                     fillcolor=_rgba(c, 0.15), line=dict(width=0), mode="lines", hoverinfo="skip",
                                     showlegend=False))
        fig.add_trace(go.Scatter(x=part[x], y=part["mean"], mode="lines", name=f"{group}={g}, {s}",
                                 line=dict(color=c, width=2, dash=dashes[s])))
    fig.update_layout(template=PAPER, width=700, height=440, title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
                      xaxis=dict(title=dict(text=x)), yaxis=dict(title=dict(text=y), type="log" if log_y else None,
                                                                 **(_log_ticks(frame[y]) if log_y else {})),
                      legend=dict(x=1.02, xanchor="left", y=1.0, yanchor="top", font=dict(size=12)))
    return fig


def share_bars(frame: pd.DataFrame, parts: Sequence[str], *, index: str = "model", xlabel: str = "share",
               title: str | None = None) -> go.Figure:
    """One horizontal bar per row of `frame` (labelled by `index`), stacked by the columns `parts`,
    each normalised to the row's total: e.g. the share of parameters in embeddings, attention and MLP."""
    totals = frame[list(parts)].sum(axis=1)
    fig = go.Figure()
    for i, part in enumerate(parts):
        share = frame[part] / totals
        fig.add_trace(go.Bar(y=frame[index], x=share, name=part, orientation="h", marker_color=COLORS[(i + 1) % len(COLORS)],
                             text=[f"{v:.0%}" if v >= 0.06 else "" for v in share], textposition="inside",
                             hovertemplate=f"{part}: %{{x:.1%}}<extra>%{{y}}</extra>"))
    left = 20 + 8 * int(frame[index].astype(str).str.len().max())  # room for the row labels
    fig.update_layout(template=PAPER, barmode="stack", width=700 + left, height=int(200 + 45 * len(frame)),
                      margin=dict(l=left, t=110), title=dict(text=title, x=0.0, xanchor="left", y=0.97, yanchor="top") if title else None,
                      xaxis=dict(title=dict(text=xlabel), tickformat=".0%", range=[0, 1]),
                      yaxis=dict(autorange="reversed", showline=False, ticks=""),
                      legend=dict(orientation="h", traceorder="normal", x=0.0, y=1.02, yanchor="bottom"))
    return fig


# ============================================================ interventions
def _token_ticks(frame: pd.DataFrame, positions: np.ndarray, max_chars: int) -> list[str] | None:
    if "input_token" not in frame.columns:
        return None
    tokens = frame.drop_duplicates("position").set_index("position")["input_token"].reindex(positions)
    return [display_token(str(t), max_chars) for t in tokens]


def difference_heatmap(frame: pd.DataFrame, value: str = "delta_target_prob", *, batch: int = 0, title: str | None = None,
                       cell_text: bool | None = None, max_chars: int = 8) -> go.Figure:
    """The lens under intervention (`lenses.compare.compare_runs`): layers (rows) by positions (columns).

    value: 'delta_target_prob' (ablated - clean probability of the target token; red = the edit lowered it,
    on a scale centred at 0), 'delta_target_loss' (nats), or 'kl' (KL(clean || ablated), nats). Each cell
    shows the ablated run's top-1 token; hover compares both runs.
    """
    titles = {"delta_target_prob": "Δ p(target)<br>ablated − clean", "delta_target_loss": "Δ loss (nats)<br>ablated − clean",
              "kl": "KL(clean ‖ ablated)<br>(nats)"}
    if value not in titles:
        raise ValueError(f"value={value!r} is not one of {sorted(titles)}")
    frame = _as_frame(frame, batch)
    missing = [c for c in ["layer", "position", "clean_top_token", "ablated_top_token", value] if c not in frame.columns]
    if missing:
        raise KeyError(f"the frame lacks columns {missing}; pass lenses.compare.compare_runs output")
    layers, positions = np.sort(frame["layer"].unique()), np.sort(frame["position"].unique())
    grid = lambda col: frame.pivot(index="layer", columns="position", values=col).reindex(index=layers, columns=positions)  # noqa: E731
    z = grid(value).to_numpy(dtype=float)
    if value == "kl":
        color = dict(colorscale="Blues", zmin=0.0, zmax=float(np.nanmax(z)) if np.isfinite(z).any() and np.nanmax(z) > 0 else 1.0)
    else:
        bound = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() and np.nanmax(np.abs(z)) > 0 else 1.0
        # RdBu runs red (low) to blue (high); for a loss, up is bad, so reverse it to keep red = worse.
        color = dict(colorscale="RdBu", zmid=0.0, zmin=-bound, zmax=bound, reversescale=value == "delta_target_loss")
    text = [[display_token(str(t), max_chars) for t in row] for row in grid("ablated_top_token").to_numpy()]
    fmt = lambda v: "–" if pd.isna(v) else f"{v:.3f}"  # noqa: E731
    hover_rows = ("layer " + frame["layer"].astype(str) + ", position " + frame["position"].astype(str)
                  + "<br>clean top: " + frame["clean_top_token"].map(lambda t: display_token(str(t)))
                  + " " + frame["clean_top_prob"].map(fmt)
                  + "<br>ablated top: " + frame["ablated_top_token"].map(lambda t: display_token(str(t)))
                  + " " + frame["ablated_top_prob"].map(fmt))
    if "clean_target_prob" in frame.columns:
        hover_rows = hover_rows + ("<br>p(target): " + frame["clean_target_prob"].map(fmt) + " → "
                                   + frame["ablated_target_prob"].map(fmt))
    hover_rows = hover_rows + "<br>KL(clean ‖ ablated) " + frame["kl"].map(fmt) + " nats"
    hover = (pd.DataFrame({"layer": frame["layer"], "position": frame["position"], "h": hover_rows})
             .pivot(index="layer", columns="position", values="h").reindex(index=layers, columns=positions).fillna(""))
    if cell_text is None:
        cell_text = len(positions) <= 40
    fig = go.Figure(go.Heatmap(
        z=z, x=positions, y=layers, **color, text=text, texttemplate="%{text}" if cell_text else None,
        textfont=dict(family=MONO, size=11), customdata=hover.to_numpy().tolist(),
        hovertemplate="%{customdata}<extra></extra>", xgap=1, ygap=1,
        colorbar=dict(title=dict(text=titles[value], side="right"), thickness=14, outlinewidth=0, ticks="outside",
                      tickformat=".2~g"),
    ))
    ticks = _token_ticks(frame, positions, max_chars)
    n_pos = len(positions)
    fig.update_layout(
        template=PAPER, title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
        width=int(min(2400, 170 + 62 * n_pos)), height=int(min(1400, 190 + 30 * len(layers))),
        xaxis=dict(title=dict(text="input token" if ticks else "position"), tickmode="array", tickvals=positions,
                   ticktext=ticks if ticks else [str(p) for p in positions], tickfont=dict(family=MONO, size=12),
                   tickangle=-45 if n_pos > 12 else 0, showline=False, ticks=""),
        yaxis=dict(title=dict(text="layer (stream after l blocks)"), tickmode="array", tickvals=layers, showline=False, ticks=""),
    )
    return fig


def patching_heatmap(df: pd.DataFrame, site: str | None = None, *, value: str = "normalized", tokens: Sequence[str] | None = None,
                     title: str | None = None, max_chars: int = 8) -> go.Figure:
    """Activation patching results (`lenskit.patching.activation_patching`) as a heatmap centred at 0.

    Per-position results of one site: layers by positions. Head results: layers by heads (all positions
    patched at once) or layer.head rows by positions. All-position results of several sites: layers by sites.
    `value` is 'normalized' (0 = no effect, 1 = the source run's metric) or 'metric'. `tokens` labels positions.
    """
    if value not in ("normalized", "metric"):
        raise ValueError(f"value must be 'normalized' or 'metric', got {value!r}")
    sites = list(dict.fromkeys(df["site"]))
    per_position = df["position"].notna().any()
    if site is None and (per_position or sites == ["head"]):
        if len(sites) > 1:
            raise ValueError(f"these results hold several sites {sites}; choose one with site=...")
        site = sites[0]
    if site is not None:
        if site not in sites:
            raise ValueError(f"site {site!r} is not in these results; they hold {sites}")
        df = df[df["site"] == site]
    if site == "head" and per_position:
        rows = df["layer"].astype(int).astype(str) + "." + df["head"].astype(int).astype(str)
        grid = df.assign(row=rows).pivot(index="row", columns="position", values=value)
        grid = grid.loc[sorted(grid.index, key=lambda r: tuple(map(int, r.split("."))))]
        ylabel, xlabel = "layer.head", "position"
    elif site == "head":
        grid, ylabel, xlabel = df.pivot(index="layer", columns="head", values=value).sort_index(), "layer", "head"
    elif per_position:
        grid, ylabel, xlabel = df.pivot(index="layer", columns="position", values=value).sort_index(), "layer", "position"
    else:
        grid = df.pivot(index="layer", columns="site", values=value).reindex(columns=sites).sort_index()
        ylabel, xlabel = "layer", "site"
    z = grid.to_numpy(dtype=float)
    bound = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() and np.nanmax(np.abs(z)) > 0 else 1.0
    if value == "normalized":
        bound = max(bound, 1.0)
    x = [str(c) for c in grid.columns]
    ticktext = x
    if xlabel == "position" and tokens is not None:
        ticktext = [display_token(str(tokens[int(c)]), max_chars) for c in grid.columns]
        xlabel = "input token"
    metric_name = df.attrs.get("metric", "metric")
    cbar = "patched fraction<br>(0 none, 1 all)" if value == "normalized" else metric_name
    fig = go.Figure(go.Heatmap(
        z=z, x=x, y=[str(i) for i in grid.index], colorscale="RdBu", zmid=0.0, zmin=-bound, zmax=bound, xgap=1, ygap=1,
        colorbar=dict(title=dict(text=cbar, side="right"), thickness=14, outlinewidth=0, ticks="outside"),
        hovertemplate=f"{ylabel} %{{y}}, {xlabel} %{{x}}: %{{z:.3f}}<extra></extra>",
    ))
    fig.update_layout(
        template=PAPER, title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
        width=int(min(2400, 200 + max(48, 10 * max(len(t) for t in ticktext)) * len(x))),
        height=int(min(1600, 170 + 28 * len(grid.index))),
        xaxis=dict(title=dict(text=xlabel), type="category", tickmode="array", tickvals=x, ticktext=ticktext,
                   tickfont=dict(family=MONO, size=12), tickangle=-45 if len(x) > 12 else 0, showline=False, ticks=""),
        yaxis=dict(title=dict(text=ylabel), type="category", showline=False, ticks=""),
    )
    return fig


def _log_ticks(values: pd.Series) -> dict:
    """Ticks at 1, 2 and 5 times the powers of ten that the positive values span (plotly's own are crowded)."""
    pos = values[values > 0]
    if pos.empty:
        return {}
    lo, hi = math.floor(math.log10(pos.min())), math.ceil(math.log10(pos.max()))
    ticks = [m * 10.0 ** e for e in range(lo, hi + 1) for m in (1, 2, 5) if pos.min() / 2 <= m * 10.0 ** e <= pos.max() * 2]
    return dict(tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])


def grouped_bars(frame: pd.DataFrame, x: str, y: str, group: str, *, pattern: str | None = None, error: str | None = None,
                 baseline: float | None = None, xlabel: str | None = None, ylabel: str | None = None,
                 title: str | None = None, log_y: bool = False) -> go.Figure:
    """One bar per row: `x` categories along the axis, one colour per `group` value and, with `pattern`, a fill
    pattern per value of that column (solid for the first, hatched for the next). `error` names a column of
    95% half-widths for error bars; `baseline` draws a dashed reference line (e.g. the intact model's value);
    `log_y` suits effects of very different sizes, when every value is positive."""
    fig = go.Figure()
    groups = list(dict.fromkeys(frame[group]))
    patterns = list(dict.fromkeys(frame[pattern])) if pattern else [None]
    shapes = ["", "/", ".", "x"]
    for p_i, p_val in enumerate(patterns):
        for g_i, g_val in enumerate(groups):
            g = frame[(frame[group] == g_val) & ((frame[pattern] == p_val) if pattern else True)]
            if g.empty:
                continue
            name = f"{g_val} ({p_val})" if pattern else str(g_val)
            color = COLORS[(g_i + 1) % len(COLORS)]
            fig.add_trace(go.Bar(
                x=g[x].astype(str), y=g[y], name=name, marker=dict(color=color, line=dict(color=color, width=1),
                pattern=dict(shape=shapes[p_i % len(shapes)], fgcolor="white", solidity=0.4) if p_i else None),
                error_y=dict(type="data", array=g[error], thickness=1, width=3, color="black") if error else None,
                hovertemplate=f"{x} %{{x}}<br>{y} %{{y:.4f}}<extra>{name}</extra>",
            ))
    if baseline is not None:
        fig.add_hline(y=baseline, line=dict(color="black", dash="dash", width=1))
    fig.update_layout(template=PAPER, barmode="group", width=int(max(640, 330 + 80 * frame[x].nunique())), height=420,
                      title=dict(text=title, x=0.0, xanchor="left") if title else None,
                      xaxis=dict(title=dict(text=xlabel or x), type="category"),
                      yaxis=dict(title=dict(text=ylabel or y), type="log" if log_y else None,
                                 **(_log_ticks(frame[y]) if log_y else {})),
                      legend=dict(x=1.02, xanchor="left", y=1.0, yanchor="top", font=dict(size=12)))
    return fig

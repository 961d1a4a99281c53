"""Lens figures: the logit-lens heatmap and per-layer curves with confidence bands."""

from __future__ import annotations

import html
import math
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lenskit.io.text import show_token

from .. import metrics
from .style import (
    COLORS,
    MONO,
    NOTEBOOK_WIDTH,
    PAPER,
    as_frame,
    display_token,
    figure_size,
    fit_text,
    font_size,
    log_ticks,
    print_meta,
    rgba,
    token_labels,
)

# ===================================================== logit-lens heatmap
HEATMAP_COLORS = {
    # color= -> (column, colour-bar title, colorscale, reversed?) ; dark always means "confident / close to the output"
    "prob": ("top_prob", "top-1 prob", "Blues", False),
    "entropy": ("entropy", "entropy (nats)", "Blues", True),
    "kl": ("kl_to_final", "KL(final ‖ lens)<br>(nats)", "Blues", True),
    "rank": ("target_rank", "target rank<br>(0 = top-1)", "Blues", True),
}


HEATMAP_CELL = (72, 44)  # px per position and per layer when nothing caps the size: 6 characters of 16 px monospace
MIN_LABELLED_CELL = 19  # px: a column that still shows 3 characters of 8 px monospace (style.fit_text)
STACK_GROWTH = 0.6  # a size preset's height grows by this share for every lens stacked under the first
KL_FLOOR = 0.01  # nats; the KL colour scale is logarithmic, and smaller values share its lightest colour


def logit_lens_heatmap(data: Any, color: str = "prob", *, batch: int = 0, title: str | None = None,
                       cell_text: bool | None = None, max_chars: int = 6, positions: slice | Sequence[int] | None = None,
                       last: int | None = None, layers: Sequence[int] | None = None, size: str | None = None,
                       width: int | None = None, height: int | None = None, clip: float = 99.0) -> go.Figure:
    """Layers (rows, the embeddings at the bottom) by positions (columns), each cell the lens's top-1 token.

    `data` is a `Trajectory` or its `to_frame()`. `color` is one of 'prob' (top-1 probability),
    'entropy' (nats, clipped at the `clip` percentile, stated on the colour bar when it cuts anything),
    'kl' (KL(final || lens), nats, log scale from 0.01) or 'rank' (of the target token, log scale).
    The bottom axis shows the input tokens, the top axis the target each position should predict;
    hover shows tokens in full and the top-k with probabilities.

    Window: `positions` (a slice or a list of positions) or `last` (the last N positions), and `layers`
    (a list of layer numbers). Size: `size='column'` (3.3 in) or `'page'` (7 in), exported at 300 dpi,
    or `width`/`height` in px; by default each cell gets room for its token, up to a notebook's width.
    Fonts, cell text and margins follow the size: labels too long for a column wrap onto a second line,
    and cell text is left out when it would be smaller than 8 px (`cell_text=True/False` forces it).

    >>> fig = logit_lens_heatmap(Trajectory.from_prompt(LogitLens(model), "import os"), color="entropy")
    >>> fig = logit_lens_heatmap(traj, last=40, size="page")
    """
    if color not in HEATMAP_COLORS:
        raise ValueError(f"color={color!r} is not one of {sorted(HEATMAP_COLORS)}")
    column, cbar_title, scale, reverse = HEATMAP_COLORS[color]
    frame = as_frame(data, batch)
    needed = ["layer", "position", "input_token", "top_token", column]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise KeyError(f"the frame lacks columns {missing}; pass Trajectory.to_frame() output")
    caption = ""
    if positions is None and last is None:  # too many positions to label: the last ones that can be, said so
        frame, caption = _last_that_fit(frame, size, width, layers)
    frame = select_window(frame, positions=positions, last=last, layers=layers)
    layers = np.sort(frame["layer"].unique())
    positions = np.sort(frame["position"].unique())
    grid = frame.pivot(index="layer", columns="position", values=column).reindex(index=layers, columns=positions)
    z = grid.to_numpy(dtype=float)
    colorbar: dict[str, Any] = dict(title=dict(text=cbar_title, side="right"), thickness=12, outlinewidth=0, ticks="outside")
    zmin, zmax = None, None
    if color == "prob":
        zmin, zmax = 0.0, 1.0
    elif color == "rank":
        z = np.log10(np.where(z >= 0, z, np.nan) + 1)  # rank 0 -> 0; no target -> blank
        top = max(1, math.ceil(np.nanmax(z)) if np.isfinite(z).any() else 1)
        ranks = [0] + [10 ** k for k in range(1, top + 1)]
        colorbar |= dict(tickvals=[math.log10(r + 1) for r in ranks], ticktext=[f"{r:,}" for r in ranks])
        zmin, zmax = 0.0, float(top)
    elif color == "kl":  # log scale: the embeddings' KL (often 10-25 nats) must not flatten the upper layers
        z, zmin, zmax, colorbar = _log_kl(z, colorbar)
    elif color == "entropy" and np.isfinite(z).any():
        zmin, zmax = 0.0, float(np.nanpercentile(z, clip))
        if np.nanmax(z) > zmax * (1 + 1e-9):
            colorbar["title"]["text"] = f"{cbar_title}<br>clipped at p{clip:g}"
            colorbar |= dict(tickformat=".2~g")

    w, h = figure_size(size, width, height, default=(min(NOTEBOOK_WIDTH, 190 + HEATMAP_CELL[0] * len(positions)),
                                                     min(1400, 190 + HEATMAP_CELL[1] * len(layers))))
    font = font_size(w, h)
    has_targets = "target_token" in frame.columns
    margin = dict(l=round(4.5 * font), r=round(1.5 * font), b=round(3.5 * font),
                  t=round((2.2 if title else 0.8) * font + (3.2 * font if has_targets else 0)))
    cell_w = (w - margin["l"] - margin["r"] - 4.5 * font) / len(positions)  # 4.5 em for the colour bar
    cell_h = (h - margin["t"] - margin["b"] - 3 * font) / len(layers)  # up to 3 em for two lines of tick labels

    inputs = frame[frame["layer"] == layers[0]].set_index("position").reindex(positions)
    xticks, tick_font = token_labels([str(t) for t in inputs["input_token"]], cell_w, font, max_chars)
    top_text = frame.pivot(index="layer", columns="position", values="top_token").reindex(index=layers, columns=positions)
    shown = [[show_token(str(t), max_chars) for t in row] for row in top_text.to_numpy()]
    text_font = fit_text(min(cell_w, 1.8 * cell_h), max((len(t) for row in shown for t in row), default=1), 0.95 * font)
    if cell_text is None:
        cell_text = text_font is not None
    text = [[html.escape(t, quote=False) for t in row] for row in shown]
    hover = _heatmap_hover(frame, layers, positions)

    fig = go.Figure(go.Heatmap(
        z=z, x=positions, y=layers, colorscale=scale, reversescale=reverse, zmin=zmin, zmax=zmax,
        text=text, texttemplate="%{text}" if cell_text else None, textfont=dict(family=MONO, size=text_font or 8),
        customdata=hover, hovertemplate="%{customdata}<extra></extra>", colorbar=colorbar, xgap=1, ygap=1,
    ))
    # Both x axes get the same fixed range (`matches` with `overlaying` breaks plotly.js's static export).
    xrange = [float(positions[0]) - 0.5, float(positions[-1]) + 0.5]
    fig.update_layout(
        template=PAPER, title=top_title(title, font),
        width=w, height=h, margin=margin, font=dict(size=font), meta=print_meta(size),
        xaxis=dict(title=dict(text=f"input token{caption}", standoff=0.4 * font), range=xrange, tickmode="array", tickvals=positions,
                   ticktext=xticks, tickfont=dict(family=MONO, size=tick_font), tickangle=0, showline=False, ticks="",
                   automargin=True),
        yaxis=dict(title=dict(text="layer"), tickmode="array", tickvals=layers,
                   ticktext=["emb" if l == 0 else str(l) for l in layers], showline=False, ticks="",
                   tickfont=dict(size=font), ticklabelstandoff=round(0.4 * font), automargin=True),
    )
    if has_targets:
        targets, _ = token_labels(["" if t is None or (isinstance(t, float) and np.isnan(t)) else str(t)
                                    for t in inputs["target_token"]], cell_w, font, max_chars, blank_empty=True)
        # An invisible trace on a second x axis carries the "next token" labels along the top.
        fig.add_trace(go.Scatter(x=positions, y=[layers[0]] * len(positions), xaxis="x2", mode="markers",
                                 marker=dict(opacity=0), hoverinfo="skip", showlegend=False))
        fig.update_layout(xaxis2=dict(overlaying="x", side="top", range=xrange, tickmode="array", tickvals=positions,
                                      ticktext=targets, tickfont=dict(family=MONO, size=tick_font, color="#555555"),
                                      tickangle=0, showline=False, ticks="", showgrid=False, automargin=True,
                                      title=dict(text="next token", font=dict(color="#555555", size=font), standoff=4)))
    return fig


def top_title(title: str | None, font: float) -> dict | None:
    """A figure title at the top edge, left-aligned with the plot, in the band the top margin keeps for it."""
    if not title:
        return None
    return dict(text=title, x=0.0, xref="paper", xanchor="left", y=1.0, yref="container", yanchor="top",
                pad=dict(t=round(0.4 * font)), font=dict(size=1.15 * font))


def _last_that_fit(frame: pd.DataFrame, size: str | None, width: int | None, layers: Sequence[int] | None) -> tuple[pd.DataFrame, str]:
    """The frame cut to the last positions whose token labels fit the figure's width, and the caption that says so
    (empty when every position fits)."""
    all_positions = np.sort(frame["position"].unique())
    w, _ = figure_size(size, width, None, default=(min(NOTEBOOK_WIDTH, 190 + HEATMAP_CELL[0] * len(all_positions)), 500))
    font = font_size(w, 500)
    room = w - 6 * font - 4.5 * font  # the side margins and the colour bar, as logit_lens_heatmap lays them out
    fit = max(1, int(room // MIN_LABELLED_CELL))
    if len(all_positions) <= fit:
        return frame, ""
    return frame[frame["position"].isin(all_positions[-fit:])], f" (last {fit} of {len(all_positions)} positions)"


def lens_stack(data: Mapping[str, Any], color: str = "prob", *, title: str | None = None, size: str | None = None,
               width: int | None = None, height: int | None = None, **window: Any) -> go.Figure:
    """Several lenses' heatmaps of one prompt, one above the other, on one shared colour scale.

    `data` maps a lens's name to its `Trajectory` (or `to_frame()`), e.g. from
    `{name: Trajectory.from_prompt(lens, prompt) for name, lens in lenses.items()}`. Each panel is
    `logit_lens_heatmap(..., color, **window)` (same window: `positions`, `last`, `layers`, `cell_text`,
    `max_chars`, `clip`, `batch`); the colour range is the union of the panels' ranges, so one colour means
    one value in every panel. Stream cells a lens does not decode stay blank.

    >>> logit_traj = Trajectory.from_prompt(LogitLens(model), "import os")
    >>> tuned_traj = Trajectory.from_prompt(tuned, "import os")
    >>> fig = lens_stack({"logit": logit_traj, "tuned": tuned_traj}, color="kl")
    """
    from plotly.subplots import make_subplots

    if not data:
        raise ValueError("lens_stack needs at least one lens's trajectory")
    n = len(data)
    probe = logit_lens_heatmap(next(iter(data.values())), color, size=size, width=width, **window)
    default_h = min(2400, probe.layout.height * n)
    if height is None and size is not None:  # a preset's height is one panel's: each lens stacked adds a share
        height = round(probe.layout.height * (1 + STACK_GROWTH * (n - 1)))
    w, h = figure_size(size, width, height, default=(probe.layout.width, default_h))
    panel_h = max(150, round(h / n))
    panels = {name: logit_lens_heatmap(d, color, width=w, height=panel_h, **window) for name, d in data.items()}
    traces = [fig.data[0] for fig in panels.values()]
    lows = [tr.zmin for tr in traces if tr.zmin is not None]
    zmin = min(lows) if lows else None
    widest = max(traces, key=lambda tr: -math.inf if tr.zmax is None else tr.zmax)
    first = next(iter(panels.values()))
    font = first.layout.font.size
    margin = dict(l=round(4.5 * font), r=round(1.5 * font), b=round(3.5 * font), t=round((3.4 if title else 2.0) * font))
    spacing = min(0.08, 0.3 / n, 2.2 * font / h)  # room for the next panel's title
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=spacing,
                        subplot_titles=[f"{name} lens" for name in panels])
    # The px one panel gets, less up to three lines of tick labels under the bottom one.
    panel_px = ((h - margin["t"] - margin["b"] - 3 * font) * (1 - spacing * (n - 1))) / n
    for row, (panel, trace) in enumerate(zip(panels.values(), traces), start=1):
        trace.update(zmin=zmin, zmax=widest.zmax, showscale=row == 1,
                     colorbar=widest.colorbar.to_plotly_json() | dict(len=1.0, y=0.5, yanchor="middle"))
        rows = len(panel.layout.yaxis.tickvals)
        if trace.texttemplate and panel_px / rows < 1.3 * trace.textfont.size:  # rows too thin for their text
            trace.update(texttemplate=None)
        fig.add_trace(trace, row=row, col=1)
        step = math.ceil(1.3 * font * rows / max(panel_px, 1))  # label every step-th layer where rows are thin
        ticktext = [t if i % step == 0 else "" for i, t in enumerate(panel.layout.yaxis.ticktext)]
        fig.update_yaxes(row=row, col=1, ticktext=ticktext, **{k: panel.layout.yaxis[k] for k in ("tickmode", "tickvals")},
                         title=dict(text="layer" if row == (n + 1) // 2 else None))
    bottom = first.layout.xaxis
    fig.update_xaxes(row=len(panels), col=1, automargin=True, title=dict(text=bottom.title.text, standoff=0.8 * font),
                     **{k: bottom[k] for k in ("tickmode", "tickvals", "ticktext", "tickfont")})
    fig.update_xaxes(range=list(bottom.range), showline=False, ticks="")
    fig.update_yaxes(showline=False, ticks="")
    fig.update_annotations(font=dict(size=font))  # the panels' titles
    fig.update_layout(template=PAPER, width=w, height=h, font=dict(size=font), meta=print_meta(size), margin=margin,
                      title=top_title(title, font))
    return fig


def select_window(frame: pd.DataFrame, *, positions: slice | Sequence[int] | None = None, last: int | None = None,
                  layers: Sequence[int] | None = None) -> pd.DataFrame:
    """The rows of the chosen positions (a slice over the sorted positions, or a list) or `last` N, and `layers`."""
    all_positions = np.sort(frame["position"].unique())
    if positions is not None and last is not None:
        raise ValueError("give positions= or last=, not both")
    if last is not None:
        if last < 1:
            raise ValueError(f"last={last} must be at least 1")
        positions = slice(-last, None)
    if isinstance(positions, slice):
        chosen = all_positions[positions]
        if len(chosen) == 0:
            raise ValueError(f"positions {positions.start}:{positions.stop} select nothing; the prompt has "
                             f"positions {all_positions[0]}..{all_positions[-1]}")
        frame = frame[frame["position"].isin(chosen)]
    elif positions is not None:
        unknown = sorted(set(positions) - set(all_positions.tolist()))
        if unknown:
            raise ValueError(f"positions {unknown} are not in the prompt, which has positions 0..{all_positions[-1]}")
        frame = frame[frame["position"].isin(list(positions))]
    if layers is not None:
        unknown = sorted(set(layers) - set(frame["layer"].unique().tolist()))
        if unknown or not len(layers):
            raise ValueError(f"layers {unknown or '[]'} are not in the trajectory; it has layers 0 (the embeddings) "
                             f"to {frame['layer'].max()}")
        frame = frame[frame["layer"].isin(list(layers))]
    return frame


def _log_kl(z: np.ndarray, colorbar: dict) -> tuple[np.ndarray, float, float, dict]:
    bottom = math.log10(KL_FLOOR)
    top = max(bottom + 1, math.log10(np.nanmax(z))) if np.isfinite(z).any() and np.nanmax(z) > 0 else bottom + 1
    exps = list(range(round(bottom), math.floor(top) + 1))
    labels = [f"≤{10.0 ** e:g}" if e == round(bottom) else f"{10.0 ** e:g}" for e in exps]
    colorbar = colorbar | dict(tickvals=exps, ticktext=labels)
    return np.log10(np.maximum(z, KL_FLOOR)), bottom, float(top), colorbar


def _heatmap_hover(frame: pd.DataFrame, layers: np.ndarray, positions: np.ndarray) -> list[list[str]]:
    k = 1
    while f"top{k + 1}_token" in frame.columns:
        k += 1
    lines = pd.Series("layer " + frame["layer"].map(lambda l: "0 (embeddings)" if l == 0 else str(l)) + ", position " + frame["position"].astype(str)
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
                 log_y: bool = False, size: str | None = None, width: int | None = None,
                 height: int | None = None) -> go.Figure:
    """Mean of `y` per layer with a shaded 95% confidence band, one line per value of `series` (e.g. 'lens').

    `data` is either raw rows (e.g. several trajectories' frames concatenated with a 'lens' and a
    'prompt' column), summarised here with `metrics.mean_ci(data, y, by=[series, x], unit=unit)`, or
    an already summarised frame with columns `x, mean, lo, hi` (plus `series`).

    With `log_y`, points whose mean is not positive (the final layer's KL to itself is exactly 0) are left
    out, and a band's lower edge stops at the line. `size`/`width`/`height` as for `logit_lens_heatmap`.

    >>> logit_df = Trajectory.from_prompt(LogitLens(model), ["import os", "def f(x):"]).to_frame().assign(lens="logit")
    >>> tuned_df = Trajectory.from_prompt(tuned, ["import os", "def f(x):"]).to_frame().assign(lens="tuned")
    >>> fig = layer_curves(pd.concat([logit_df, tuned_df]), "kl_to_final", series="lens", unit="batch")  # one band per lens
    """
    keys = [series, x] if series else [x]
    summary = data if {"mean", "lo", "hi"} <= set(data.columns) else metrics.mean_ci(data, y, by=keys, unit=unit)
    if log_y:  # a log axis cannot show 0: drop those points, and keep bands above 0
        summary = summary[summary["mean"] > 0]
        summary = summary.assign(lo=summary["lo"].where(summary["lo"] > 0, summary["mean"]))
    groups: Sequence[tuple[Any, pd.DataFrame]] = list(summary.groupby(series, sort=False)) if series else [(None, summary)]
    fig = go.Figure()
    for i, (name, g) in enumerate(groups):
        g = g.sort_values(x)
        c = COLORS[i % len(COLORS)]
        band = g.dropna(subset=["lo", "hi"])
        if len(band):
            fig.add_trace(go.Scatter(
                x=np.concatenate([band[x], band[x][::-1]]), y=np.concatenate([band["hi"], band["lo"][::-1]]),
                fill="toself", fillcolor=rgba(c, 0.18), line=dict(width=0), mode="lines", hoverinfo="skip",
                showlegend=False, legendgroup=str(name),
            ))
        fig.add_trace(go.Scatter(
            x=g[x], y=g["mean"], mode="lines+markers", name=str(name) if name is not None else y,
            line=dict(color=c, width=2), marker=dict(size=6), legendgroup=str(name),
            hovertemplate=f"{x} %{{x}}<br>mean %{{y:.3f}}<extra>{name if name is not None else ''}</extra>",
        ))
    w, h = figure_size(size, width, height, default=(600, 400))
    font = font_size(w, h)
    xs = [v for v in np.sort(summary[x].unique()) if float(v).is_integer()]  # writes drawn at l + 0.5 get no tick
    layer_ticks = dict(tickmode="array", tickvals=xs, ticktext=["emb" if v == 0 else f"{v:g}" for v in xs]) \
        if x == "layer" and 0 < len(xs) <= 40 else dict(dtick=1)
    fig.update_layout(
        template=PAPER, width=w, height=h, showlegend=series is not None, font=dict(size=font), meta=print_meta(size),
        margin=dict(l=round(4.5 * font), r=round(1.5 * font), t=round((2.6 if title else 1.2) * font), b=round(3.6 * font)),
        title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
        xaxis=dict(title=dict(text=x), automargin=True, **layer_ticks), yaxis=dict(title=dict(text=ylabel or y), type="log" if log_y else None, automargin=True,
                   **(log_ticks(pd.concat([summary["lo"], summary["mean"], summary["hi"]]).dropna()) if log_y else {})),
        legend=dict(x=0.98, xanchor="right", y=0.98, yanchor="top"),
    )
    return fig

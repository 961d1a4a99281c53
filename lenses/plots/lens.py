"""Lens figures: the logit-lens heatmap and per-layer curves with confidence bands."""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .. import metrics
from .style import COLORS, MONO, PAPER, _as_frame, _log_ticks, _rgba, display_token

# ===================================================== logit-lens heatmap
HEATMAP_COLORS = {
    # color= -> (column, colour-bar title, colorscale, reversed?) ; dark always means "confident / close to the output"
    "prob": ("top_prob", "top-1 prob", "Blues", False),
    "entropy": ("entropy", "entropy (nats)", "Blues", True),
    "kl": ("kl_to_final", "KL(final ‖ lens)<br>(nats)", "Blues", True),
    "rank": ("target_rank", "target rank<br>(0 = top-1)", "Blues", True),
}


HEATMAP_CELL = (72, 44)  # px per position and per layer: room for 6 characters of 16 px monospace


def logit_lens_heatmap(data: Any, color: str = "prob", *, batch: int = 0, title: str | None = None,
                       cell_text: bool | None = None, max_chars: int = 6) -> go.Figure:
    """Layers (rows, stream 0 at the bottom) by positions (columns), each cell the lens's top-1 token.

    `data` is a `Trajectory` or its `to_frame()`. `color` is one of 'prob' (top-1 probability),
    'entropy', 'kl' (KL(final || lens), nats) or 'rank' (of the target token, log scale). The bottom
    axis shows the input tokens, the top axis the target each position should predict. Hover shows
    the top-k with probabilities. Cell text is on unless there are more than 40 positions.

    >>> fig = logit_lens_heatmap(Trajectory.from_prompt(LogitLens(model), "import os"), color="entropy")
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
        xaxis=dict(title=dict(text=x), dtick=1), yaxis=dict(title=dict(text=ylabel or y), type="log" if log_y else None,
                   **(_log_ticks(pd.concat([summary["lo"], summary["mean"], summary["hi"]]).dropna()) if log_y else {})),
        legend=dict(x=0.98, xanchor="right", y=0.98, yanchor="top"),
    )
    return fig

"""Residual-stream anatomy figures: stream norms, direct logit attribution, growth with depth, shares."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .. import metrics
from .lens import layer_curves
from .style import COLORS, MONO, PAPER, as_frame, log_ticks, rgba


def resid_norm_curves(norms: pd.DataFrame, y: str = "rms", *, title: str | None = None, log_y: bool = False) -> go.Figure:
    """Stream and write sizes by layer from `anatomy.resid_norms`: mean over sequences, 95% bands.

    A write of block l is drawn at l + 0.5, between the stream it reads (l) and the one it lands in (l + 1).
    """
    frame = norms.assign(layer=norms["layer"] + np.where(norms["component"] == "resid", 0.0, 0.5))
    label = {"rms": "RMS per entry", "mean_norm": "L2 norm"}.get(y, y)
    fig = layer_curves(frame, y, series="component", unit="batch", ylabel=label, title=title, log_y=log_y)
    fig.update_layout(width=700, legend=dict(x=1.02, xanchor="left", y=1.0, yanchor="top"))
    if log_y:
        fig.update_yaxes(**log_ticks(frame[y]))
    return fig


def attribution_bars(dla: pd.DataFrame, *, batch: int = 0, title: str | None = None) -> go.Figure:
    """Each part's direct logit attribution (`anatomy.direct_logit_attribution`) as bars, first part on top."""
    frame = as_frame(dla, batch)
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
    frame = as_frame(dla, batch)
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
    for (s, g), part in summary.groupby([style, group], sort=False):
        c = COLORS[list(summary[group].unique()).index(g) % len(COLORS)]
        band = part.dropna(subset=["lo", "hi"])
        if len(band):
            fig.add_trace(go.Scatter(x=np.concatenate([band[x], band[x][::-1]]),
                                     y=np.concatenate([band["hi"], band["lo"][::-1]]), fill="toself",
                                     fillcolor=rgba(c, 0.15), line=dict(width=0), mode="lines", hoverinfo="skip",
                                     showlegend=False))
        fig.add_trace(go.Scatter(x=part[x], y=part["mean"], mode="lines", name=f"{group}={g}, {s}",
                                 line=dict(color=c, width=2, dash=dashes[s])))
    fig.update_layout(template=PAPER, width=700, height=440, title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
                      xaxis=dict(title=dict(text=x)), yaxis=dict(title=dict(text=y), type="log" if log_y else None,
                                                                 **(log_ticks(frame[y]) if log_y else {})),
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

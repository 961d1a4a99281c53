"""Tuned-lens diagnostics from Belrose et al. 2023: the layer-transfer heatmap (`lenses.transfer`) and causal
fidelity (`lenses.causal`). The numbers are computed there; these functions only draw them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .lens import KL_FLOOR, layer_curves
from .style import COLORS, PAPER, figure_size, font_size, log_ticks, print_meta


def _layer_label(layer: Any) -> str:
    return "emb" if int(layer) == 0 else str(int(layer))


def transfer_heatmap(matrix: pd.DataFrame, *, label: str = "KL penalty<br>(nats)", title: str | None = None,
                     cell_text: bool | None = None, size: str | None = None, width: int | None = None,
                     height: int | None = None) -> go.Figure:
    """A [translator, stream] matrix (`layer_transfer`, or its `transfer_penalty`) as a heatmap: one row per
    translator (the stream it was trained for, the embeddings at the bottom), one column per stream it reads.

    A matrix with negative entries (a penalty: another translator reading a stream better than its own) gets
    a linear diverging scale centred on 0, red where transfer costs; one without gets a sequential logarithmic
    scale from 0.01 nats (dark = large), so that one far-off column (the embeddings') does not wash out the
    rest. Each cell shows its value when cells are wide enough (`cell_text` forces it on or off).

    >>> from lenses.transfer import layer_transfer, transfer_penalty
    >>> fig = transfer_heatmap(transfer_penalty(layer_transfer(model, tuned, windows, progress=False)))
    """
    if matrix.empty or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"expected a square [translator, stream] matrix from layer_transfer, got shape {matrix.shape}")
    z = matrix.to_numpy(dtype=float)
    rows, cols = list(matrix.index), list(matrix.columns)
    finite = z[np.isfinite(z)]
    colorbar: dict[str, Any] = dict(title=dict(text=label, side="right"), thickness=12, outlinewidth=0)
    if finite.size and finite.min() < 0:
        bound = float(np.abs(finite).max()) or 1.0
        color, scale = z, dict(colorscale="RdBu", reversescale=True, zmid=0.0, zmin=-bound, zmax=bound)
    else:
        bottom = math.log10(KL_FLOOR)
        top = max(bottom + 1, math.log10(finite.max())) if finite.size and finite.max() > 0 else bottom + 1
        exps = list(range(round(bottom), math.floor(top) + 1))
        colorbar |= dict(tickvals=exps, ticktext=[f"≤{10.0 ** e:g}" if e == exps[0] else f"{10.0 ** e:g}" for e in exps])
        color, scale = np.log10(np.maximum(z, KL_FLOOR)), dict(colorscale="Blues", zmin=bottom, zmax=top)
    n = len(cols)
    w, h = figure_size(size, width, height, default=(min(900, 220 + 56 * n), min(860, 160 + 44 * n)))
    font = font_size(w, h)
    if cell_text is None:
        cell_text = (w - 6 * font) / n >= 3.2 * font  # room for "0.00" in the body font
    fig = go.Figure(go.Heatmap(
        z=color, x=[str(c) for c in cols], y=[str(r) for r in rows], xgap=1, ygap=1, **scale, customdata=z,
        text=[[f"{v:.2f}" if np.isfinite(v) else "" for v in row] for row in z],
        texttemplate="%{text}" if cell_text else None, textfont=dict(size=0.8 * font), colorbar=colorbar,
        hovertemplate="translator %{y}, stream %{x}: %{customdata:.4f} nats<extra></extra>",
    ))
    fig.update_layout(
        template=PAPER, width=w, height=h, font=dict(size=font), meta=print_meta(size),
        margin=dict(l=round(5 * font), r=round(1.5 * font), b=round(3.6 * font), t=round((2.6 if title else 1.0) * font)),
        title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
        xaxis=dict(title=dict(text="stream read (after this many blocks)"), tickmode="array", tickvals=[str(c) for c in cols],
                   ticktext=[_layer_label(c) for c in cols], showline=False, ticks="", type="category"),
        yaxis=dict(title=dict(text="translator trained for stream"), tickmode="array", tickvals=[str(r) for r in rows],
                   ticktext=[_layer_label(r) for r in rows], showline=False, ticks="", type="category"),
    )
    return fig


def fidelity_curves(summary: pd.DataFrame, *, title: str | None = None, size: str | None = None,
                    width: int | None = None, height: int | None = None) -> go.Figure:
    """Causal fidelity by stream: Spearman's rho between the lens's and the model's influence of each causal-basis
    direction, with its interval, one line per lens. `summary` has columns lens, stream, rho, lo, hi (one row
    per lens and stream, e.g. `metrics.bootstrap_spearman` per stream)."""
    missing = [c for c in ("lens", "stream", "rho", "lo", "hi") if c not in summary.columns]
    if missing:
        raise KeyError(f"fidelity_curves needs columns {missing}; the frame has {list(summary.columns)}")
    curves = summary.rename(columns={"stream": "layer", "rho": "mean"})[["lens", "layer", "mean", "lo", "hi"]]
    fig = layer_curves(curves, "rho", series="lens", ylabel="Spearman ρ, lens vs model influence", title=title,
                       size=size, width=width, height=height)
    fig.update_yaxes(range=[-1.05, 1.05], zeroline=True, zerolinecolor="#bbbbbb")
    fig.update_xaxes(title_text="stream (after this many blocks)")
    fig.update_layout(legend=dict(y=0.02, yanchor="bottom"))  # rho is mostly high: the legend goes low
    return fig


def fidelity_scatter(table: pd.DataFrame, *, title: str | None = None, size: str | None = None,
                     width: int | None = None, height: int | None = None) -> go.Figure:
    """Each causal-basis direction as a point: its influence on the lens (x) against its influence on the model
    (y), both KL in nats on log axes, one colour per stream. `table` has columns stream, direction,
    lens_influence, model_influence (`causal_fidelity` rows, with a stream column added)."""
    missing = [c for c in ("stream", "direction", "lens_influence", "model_influence") if c not in table.columns]
    if missing:
        raise KeyError(f"fidelity_scatter needs columns {missing}; the frame has {list(table.columns)}")
    fig = go.Figure()
    for i, (stream, part) in enumerate(table.groupby("stream", sort=True)):
        fig.add_trace(go.Scatter(
            x=part["lens_influence"], y=part["model_influence"], mode="markers", name=f"stream {_layer_label(stream)}",
            marker=dict(color=COLORS[(i + 1) % len(COLORS)], size=8, line=dict(width=0.5, color="white")),
            customdata=part["direction"], hovertemplate=(f"stream {_layer_label(stream)}, direction %{{customdata}}<br>"
                                                         "lens %{x:.3g} nats, model %{y:.3g} nats<extra></extra>"),
        ))
    w, h = figure_size(size, width, height, default=(620, 480))
    font = font_size(w, h)
    fig.update_layout(
        template=PAPER, width=w, height=h, font=dict(size=font), meta=print_meta(size),
        title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
        xaxis=dict(title=dict(text="influence on the lens, KL (nats)"), type="log", **log_ticks(table["lens_influence"])),
        yaxis=dict(title=dict(text="influence on the model, KL (nats)"), type="log", **log_ticks(table["model_influence"])),
        legend=dict(x=0.02, xanchor="left", y=0.98, yanchor="top"),
    )
    return fig

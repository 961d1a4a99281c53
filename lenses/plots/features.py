"""The feature lens's figure: for each lens, streams (rows) by rank (columns), each cell a promoted (or suppressed)
token coloured by its reading (`lenses.features.feature_lens`'s frame)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import FONT, MONO, PAPER, display_token, figure_size


def feature_lens_heatmap(frame: pd.DataFrame, kind: str = "promoted", *, title: str | None = None, max_chars: int = 8,
                         size: str | None = None, width: int | None = None, height: int | None = None) -> go.Figure:
    """One panel per lens, side by side on one colour scale: layer (rows, deepest on top) by rank (columns)."""
    if kind not in ("promoted", "suppressed"):
        raise ValueError(f"kind must be 'promoted' or 'suppressed', got {kind!r}")
    missing = [c for c in ("lens", "layer", "kind", "rank", "token", "logit") if c not in frame.columns]
    if missing:
        raise KeyError(f"the frame lacks columns {missing}; pass lenses.features.feature_lens output")
    part = frame[frame["kind"] == kind]
    names = list(dict.fromkeys(part["lens"]))
    if not names:
        raise ValueError(f"the frame holds no {kind} rows")
    bound = float(np.nanmax(np.abs(part["logit"].to_numpy(dtype=float)))) or 1.0
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, shared_yaxes=True, horizontal_spacing=0.03)
    for c, name in enumerate(names, start=1):
        one = part[part["lens"] == name]
        z = one.pivot(index="layer", columns="rank", values="logit").sort_index()
        tok = one.pivot(index="layer", columns="rank", values="token").reindex_like(z)
        text = [[display_token(str(t), max_chars) for t in row] for row in tok.to_numpy()]
        fig.add_trace(go.Heatmap(z=z.to_numpy(dtype=float), x=[str(r) for r in z.columns], y=[str(l) for l in z.index],
                                 text=text, texttemplate="%{text}", textfont=dict(family=MONO, size=10),
                                 colorscale="RdBu", zmid=0.0, zmin=-bound, zmax=bound, showscale=c == len(names),
                                 hovertemplate="stream %{y}, rank %{x}: %{text}<br>reading %{z:.3f}<extra>" + name + "</extra>"),
                      row=1, col=c)
        fig.update_xaxes(title_text="rank", row=1, col=c)
    fig.update_yaxes(title_text="stream (layer)", row=1, col=1)
    n_layers = part["layer"].nunique()
    w, h = figure_size(size, width, height, default=(min(1400, 120 + 70 * len(names) * part["rank"].nunique()), 160 + 34 * n_layers))
    feat = frame.attrs.get("feature")
    head = title or (f"Feature {feat} at {frame.attrs.get('hook')}: {kind} tokens ({frame.attrs.get('mode', 'direction')})"
                     if feat is not None else f"{kind} tokens")
    fig.update_layout(title=dict(text=head, x=0.01), width=w, height=h, font=dict(family=FONT, size=12),
                      template=PAPER, margin=dict(l=60, r=20, t=70, b=50))
    return fig

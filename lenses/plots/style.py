"""House style shared by every figure: fonts, colours, token labels, and small helpers."""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from lenskit.text import show_token

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
    """`lenskit.text.show_token` (visible whitespace, escaped control characters), HTML-escaped for plotly.

    Control characters must go: they would also make the SVG that static export rasterises invalid XML.
    """
    return html.escape(show_token(text, max_chars), quote=False)  # plotly reads '<' as the start of a tag


def _as_frame(data: Any, batch: int) -> pd.DataFrame:
    frame = data.to_frame() if hasattr(data, "to_frame") else data
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"expected a Trajectory or its to_frame() DataFrame, got {type(data).__name__}")
    if "batch" in frame.columns:
        if batch not in set(frame["batch"]):
            raise ValueError(f"batch={batch} is not in this trajectory; it holds sequences {sorted(set(frame['batch']))}")
        frame = frame[frame["batch"] == batch]
    return frame


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def _log_ticks(values: pd.Series) -> dict:
    """Ticks at 1, 2 and 5 times the powers of ten that the positive values span (plotly's own are crowded)."""
    pos = values[values > 0]
    if pos.empty:
        return {}
    lo, hi = math.floor(math.log10(pos.min())), math.ceil(math.log10(pos.max()))
    ticks = [m * 10.0 ** e for e in range(lo, hi + 1) for m in (1, 2, 5) if pos.min() / 2 <= m * 10.0 ** e <= pos.max() * 2]
    return dict(tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])

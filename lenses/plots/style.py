"""House style shared by every figure: fonts, colours, token labels, and small helpers."""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from lenskit.io.text import show_token

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


# ------------------------------------------------------------------ sizes
PX_PER_IN = 96  # plotly's layout pixels are CSS pixels: a PDF page of width w px is w / 96 inches wide
PRINT_DPI = 300
SIZES = {"column": (3.3, 2.6), "page": (7.0, 3.6)}
"""Presets in inches: one column of a two-column paper, and the full text width (drawn at 300 dpi)."""
NOTEBOOK_WIDTH = 1100  # px; the widest a figure gets by default, so that it fits a notebook's cell


def figure_size(size: str | None, width: int | None, height: int | None, default: tuple[int, int]) -> tuple[int, int]:
    """(width, height) in px: an explicit `width`/`height` wins, then the `size` preset, then `default`."""
    if size is not None and size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {sorted(SIZES)} (a column is {SIZES['column'][0]} in, a page "
                         f"{SIZES['page'][0]} in wide); or pass width= and height= in px")
    w, h = (round(v * PX_PER_IN) for v in SIZES[size]) if size else default
    for name, value in (("width", width), ("height", height)):
        if value is not None and value < 150:
            raise ValueError(f"{name}={value} px is too small to draw a figure in; give at least 150 (96 px = 1 inch)")
    return int(width or w), int(height or h)


def font_size(width: int, height: int) -> float:
    """The body font in px for a figure of this size: 9 px (about 7 pt in print) at a column's width, rising
    to 16 px for wide figures, never more than the height allows."""
    return float(max(9.0, min(16.0, 9.0 + (width - 320) / 60, 9.0 + (height - 240) / 40)))


def print_meta(size: str | None) -> dict:
    """layout.meta for a figure sized by a preset: `save_figure` draws it at `PRINT_DPI`."""
    return {"export_scale": PRINT_DPI / PX_PER_IN} if size else {}


MONO_EM = 0.62  # a monospace character's width in em (DejaVu Sans Mono: 0.602)


def fit_text(cell_px: float, chars: int, largest: float, smallest: float = 8.0) -> float | None:
    """The largest monospace font (px, at most `largest`) that fits `chars` characters into `cell_px`,
    or None when even `smallest` does not fit."""
    size = min(largest, 0.9 * (cell_px - 2) / (MONO_EM * max(chars, 1)))  # 10% to spare: some glyphs fall back
    return float(size) if size >= smallest else None


def token_labels(tokens: list[str], cell_px: float, font: float, max_chars: int,
                  blank_empty: bool = False) -> tuple[list[str], float]:
    """Tick labels that fit a column `cell_px` wide, never rotated and never wrapped inside a token: the largest
    font up to `font` that fits each token on one line; else 8 px with long tokens cut with '…'; else, for very
    narrow columns, every k-th label. Returns the labels (HTML) and their font size."""
    shown = ["" if blank_empty and t == "" else show_token(t, max_chars) for t in tokens]
    longest = max((len(t) for t in shown), default=1)
    size = fit_text(cell_px, longest, font)
    if size is not None:
        return [html.escape(t, quote=False) for t in shown], size
    per_line = max(1, int(0.9 * (cell_px - 2) / (MONO_EM * 8)))
    cut = [t if len(t) <= per_line else (t[: per_line - 1] + "…" if per_line > 1 else t[:1]) for t in shown]
    labels = [html.escape(t, quote=False) for t in cut]
    if per_line < 2:  # under two characters a column: label every k-th position only
        step = math.ceil((2 * MONO_EM * 8 + 2) / max(cell_px, 1))  # columns that two characters need
        labels = [label if i % step == 0 else "" for i, label in enumerate(labels)]
    return labels, 8.0


def display_token(text: str, max_chars: int | None = None) -> str:
    """`lenskit.io.text.show_token` (visible whitespace, escaped control characters), HTML-escaped for plotly.

    Control characters must go: they would also make the SVG that static export rasterises invalid XML.
    """
    return html.escape(show_token(text, max_chars), quote=False)  # plotly reads '<' as the start of a tag


def as_frame(data: Any, batch: int) -> pd.DataFrame:
    frame = data.to_frame() if hasattr(data, "to_frame") else data
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"expected a Trajectory or its to_frame() DataFrame, got {type(data).__name__}")
    if "batch" in frame.columns:
        if batch not in set(frame["batch"]):
            raise ValueError(f"batch={batch} is not in this trajectory; it holds sequences {sorted(set(frame['batch']))}")
        frame = frame[frame["batch"] == batch]
    return frame


def rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def log_ticks(values: pd.Series) -> dict:
    """Ticks at 1, 2 and 5 times the powers of ten that the positive values span (plotly's own are crowded)."""
    pos = values[values > 0]
    if pos.empty:
        return {}
    lo, hi = math.floor(math.log10(pos.min())), math.ceil(math.log10(pos.max()))
    ticks = [m * 10.0 ** e for e in range(lo, hi + 1) for m in (1, 2, 5) if pos.min() / 2 <= m * 10.0 ** e <= pos.max() * 2]
    return dict(tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])

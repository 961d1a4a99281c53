"""Intervention figures: difference heatmaps, activation-patching heatmaps, grouped bars."""

from __future__ import annotations

import html
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lenskit.io.text import show_token

from .lens import select_window
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
    token_labels,
)


def difference_heatmap(frame: pd.DataFrame, value: str = "delta_target_prob", *, batch: int = 0, title: str | None = None,
                       cell_text: bool | None = None, max_chars: int = 8, positions: slice | Sequence[int] | None = None,
                       last: int | None = None, layers: Sequence[int] | None = None, size: str | None = None,
                       width: int | None = None, height: int | None = None) -> go.Figure:
    """The lens under intervention (`lenses.compare.compare_runs`): layers (rows) by positions (columns).

    value: 'delta_target_prob' (ablated - clean probability of the target token; red = the edit lowered it,
    on a scale centred at 0), 'delta_target_loss' (nats), or 'kl' (KL(clean || ablated), nats). Each cell
    shows the ablated run's top-1 token; hover compares both runs. The window (`positions`, `last`,
    `layers`) and the size (`size`, `width`, `height`) work as for `logit_lens_heatmap`.
    """
    titles = {"delta_target_prob": "Δ p(target)<br>ablated − clean", "delta_target_loss": "Δ loss (nats)<br>ablated − clean",
              "kl": "KL(clean ‖ ablated)<br>(nats)"}
    if value not in titles:
        raise ValueError(f"value={value!r} is not one of {sorted(titles)}")
    frame = as_frame(frame, batch)
    missing = [c for c in ["layer", "position", "clean_top_token", "ablated_top_token", value] if c not in frame.columns]
    if missing:
        raise KeyError(f"the frame lacks columns {missing}; pass lenses.compare.compare_runs output")
    frame = select_window(frame, positions=positions, last=last, layers=layers)
    layers, positions = np.sort(frame["layer"].unique()), np.sort(frame["position"].unique())
    grid = lambda col: frame.pivot(index="layer", columns="position", values=col).reindex(index=layers, columns=positions)  # noqa: E731
    z = grid(value).to_numpy(dtype=float)
    if value == "kl":
        color = dict(colorscale="Blues", zmin=0.0, zmax=float(np.nanmax(z)) if np.isfinite(z).any() and np.nanmax(z) > 0 else 1.0)
    else:
        bound = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() and np.nanmax(np.abs(z)) > 0 else 1.0
        # RdBu runs red (low) to blue (high); for a loss, up is bad, so reverse it to keep red = worse.
        color = dict(colorscale="RdBu", zmid=0.0, zmin=-bound, zmax=bound, reversescale=value == "delta_target_loss")
    shown = [[show_token(str(t), max_chars) for t in row] for row in grid("ablated_top_token").to_numpy()]
    text = [[html.escape(t, quote=False) for t in row] for row in shown]
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
    w, h = figure_size(size, width, height, default=(min(NOTEBOOK_WIDTH, 200 + 62 * len(positions)),
                                                     min(1400, 200 + 32 * len(layers))))
    font = font_size(w, h)
    margin = dict(l=round(4.5 * font), r=round(1.5 * font), t=round((2.6 if title else 1.0) * font), b=round(3.5 * font))
    cell_w = (w - margin["l"] - margin["r"] - 6 * font) / len(positions)  # 6 em for the colour bar and its title
    cell_h = (h - margin["t"] - margin["b"] - 3 * font) / len(layers)
    text_font = fit_text(min(cell_w, 1.8 * cell_h), max((len(t) for row in shown for t in row), default=1), 0.9 * font)
    if cell_text is None:
        cell_text = text_font is not None
    fig = go.Figure(go.Heatmap(
        z=z, x=positions, y=layers, **color, text=text, texttemplate="%{text}" if cell_text else None,
        textfont=dict(family=MONO, size=text_font or 8), customdata=hover.to_numpy().tolist(),
        hovertemplate="%{customdata}<extra></extra>", xgap=1, ygap=1,
        colorbar=dict(title=dict(text=titles[value], side="right"), thickness=12, outlinewidth=0, ticks="outside",
                      tickformat=".2~g"),
    ))
    if "input_token" in frame.columns:
        tokens = frame.drop_duplicates("position").set_index("position")["input_token"].reindex(positions)
        ticks, tick_font = token_labels([str(t) for t in tokens], cell_w, font, max_chars)
    else:
        ticks, tick_font = [str(p) for p in positions], font
    fig.update_layout(
        template=PAPER, title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
        width=w, height=h, margin=margin, font=dict(size=font), meta=print_meta(size),
        xaxis=dict(title=dict(text="input token" if "input_token" in frame.columns else "position", standoff=0.4 * font),
                   tickmode="array", tickvals=positions, ticktext=ticks, tickfont=dict(family=MONO, size=tick_font),
                   tickangle=0, showline=False, ticks="", automargin=True),
        yaxis=dict(title=dict(text="layer (stream after l blocks)"), tickmode="array", tickvals=layers,
                   ticktext=["emb" if l == 0 else str(l) for l in layers], showline=False, ticks="", automargin=True),
    )
    return fig


def patching_heatmap(df: pd.DataFrame, site: str | None = None, *, value: str = "normalized", tokens: Sequence[str] | None = None,
                     title: str | None = None, max_chars: int = 8) -> go.Figure:
    """Activation patching results (`lenskit.intervene.patching.activation_patching`) as a heatmap centred at 0.

    Per-position results of one site: layers by positions. Head results: layers by heads (all positions
    patched at once) or layer.head rows by positions. All-position results of several sites: layers by sites.
    `value` is 'normalized' (0 = no effect, 1 = the source run's metric) or 'metric'. `tokens` labels positions.
    """
    if value not in ("normalized", "metric"):
        raise ValueError(f"value must be 'normalized' or 'metric', got {value!r}")
    sites = list(dict.fromkeys(df["site"]))
    per_position = df["position"].notna().any()
    if site is None and (per_position or (len(sites) == 1 and df["head"].notna().any())):
        if len(sites) > 1:
            raise ValueError(f"these results hold several sites {sites}; choose one with site=...")
        site = sites[0]
    if site is not None:
        if site not in sites:
            raise ValueError(f"site {site!r} is not in these results; they hold {sites}")
        df = df[df["site"] == site]
    heads = site is not None and df["head"].notna().any()  # a head site: head (z), q, k, v or pattern
    if heads and per_position:
        rows = df["layer"].astype(int).astype(str) + "." + df["head"].astype(int).astype(str)
        grid = df.assign(row=rows).pivot(index="row", columns="position", values=value)
        grid = grid.loc[sorted(grid.index, key=lambda r: tuple(map(int, r.split("."))))]
        ylabel, xlabel = "layer.head", "position"
    elif heads:
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
    metric_name = df.attrs.get("metric", "metric")
    cbar = "patched fraction<br>(0 none, 1 all)" if value == "normalized" else metric_name
    fig = go.Figure(go.Heatmap(
        z=z, x=x, y=[str(i) for i in grid.index], colorscale="RdBu", zmid=0.0, zmin=-bound, zmax=bound, xgap=1, ygap=1,
        colorbar=dict(title=dict(text=cbar, side="right"), thickness=14, outlinewidth=0, ticks="outside"),
        hovertemplate=f"{ylabel} %{{y}}, {xlabel} %{{x}}: %{{z:.3f}}<extra></extra>",
    ))
    w, h = min(NOTEBOOK_WIDTH, 200 + 62 * len(x)), int(min(1400, 170 + 28 * len(grid.index)))
    font = font_size(w, h)
    cell_w = (w - 6.0 * font - 120) / len(x)  # the y labels and the colour bar take the rest
    ticktext, tick_font = x, font
    if xlabel == "position" and tokens is not None:
        ticktext, tick_font = token_labels([str(tokens[int(c)]) for c in grid.columns], cell_w, font, max_chars)
        xlabel = "input token"
    elif len(x) > 1:
        ticktext, tick_font = token_labels(x, cell_w, font, max(len(t) for t in x))
    fig.update_layout(
        template=PAPER, title=dict(text=title, x=0.0, xref="paper", xanchor="left") if title else None,
        width=w, height=h, font=dict(size=font),
        xaxis=dict(title=dict(text=xlabel), type="category", tickmode="array", tickvals=x, ticktext=ticktext,
                   tickfont=dict(family=MONO, size=tick_font), tickangle=0, showline=False, ticks="", automargin=True),
        yaxis=dict(title=dict(text=ylabel), type="category", showline=False, ticks="", automargin=True),
    )
    return fig




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
                                 **(log_ticks(frame[y]) if log_y else {})),
                      legend=dict(x=1.02, xanchor="left", y=1.0, yanchor="top", font=dict(size=12)))
    return fig

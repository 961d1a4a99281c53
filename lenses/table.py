"""A lens trajectory's frame as a plain-text table: layers by positions of top-1 tokens, for terminals and logs."""

from __future__ import annotations

import shutil

import pandas as pd

from lenskit.io.text import show_token


def format_table(frame: pd.DataFrame, max_chars: int = 8, width: int | None = None) -> str:
    """Layers (rows, 0 = the embeddings) by positions (columns) of top-1 tokens, wrapped to the terminal's width."""
    positions = sorted(frame["position"].unique())
    layers = sorted(frame["layer"].unique())
    top = frame.pivot(index="layer", columns="position", values="top_token")
    inputs = frame[frame["layer"] == layers[0]].set_index("position")["input_token"]
    cols = {p: [show_token(str(inputs[p]), max_chars)] + [show_token(str(top.loc[l, p]), max_chars) for l in layers] for p in positions}
    widths = {p: max(len(c) for c in cols[p]) for p in positions}
    labels = ["input"] + [f"layer {l}" for l in layers]
    label_w = max(len(s) for s in labels)
    width = width or shutil.get_terminal_size((120, 24)).columns
    blocks, current, used = [], [], label_w
    for p in positions:  # wrap the positions into blocks that fit the width
        if current and used + 2 + widths[p] > width:
            blocks.append(current)
            current, used = [], label_w
        current.append(p)
        used += 2 + widths[p]
    blocks.append(current)
    lines = []
    for block in blocks:
        for row, label in enumerate(labels):
            lines.append(label.rjust(label_w) + "".join("  " + cols[p][row].ljust(widths[p]) for p in block).rstrip())
            if row == 0:
                lines.append("-" * min(width, label_w + sum(2 + widths[p] for p in block)))
        lines.append("")
    return "\n".join(lines).rstrip("\n")

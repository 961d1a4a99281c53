"""An interactive view of a prompt: every lens's table (hover a cell for its top-k tokens and probabilities, click
to pin it) and the attention patterns (a grid of every layer's heads; click one for its pattern with token labels).

The view is one self-contained HTML file: the data as JSON, and the script and style shipped in this package
(`view.js`, `view.css`), inlined; it opens offline and needs no plotly. In Jupyter it displays inline.

>>> view = View.from_prompt(model, "def add(a, b):\\n    return a + b", lenses={"logit": LogitLens(model)})
>>> path = view.save("view.html")   # or show `view` as a notebook cell's value
"""

from __future__ import annotations

import html
import json
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import pandas as pd

if TYPE_CHECKING:
    from lenses.base import Lens
    from lenskit import HookedTransformer

MAX_ATTENTION_POSITIONS = 64  # the last positions whose patterns the view holds (a pattern grows as pos^2 per head)


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _shown(token: str) -> str:
    from lenskit.io.text import show_token

    return show_token(str(token), 12)


def attention_patterns(model: "HookedTransformer", prompt: str) -> dict:
    """`{"tokens", "patterns": [layer][head][query][key]}` of the prompt's last MAX_ATTENTION_POSITIONS positions, the
    prompt tokenized as `Trajectory.from_prompt` tokenizes it; only layers with softmax attention are listed."""
    import torch

    from lenses.trajectory import tokens_and_lengths

    tokens, _ = tokens_and_lengths(model, prompt)
    names = [n for n in model.hook_dict if n.endswith("attn.hook_pattern")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
    last = slice(-MAX_ATTENTION_POSITIONS, None)
    return {"tokens": [_shown(t) for t in model.to_str_tokens(tokens[0])][last], "layers": [int(n.split(".")[1]) for n in names],
            "patterns": [cache[n][0][:, last, last].float().round(decimals=3).tolist() for n in names]}


class View:
    """Lens tables (`frames`: lens name -> `Trajectory.to_frame()` of one prompt, with top-k columns) and, if given,
    attention patterns (`attention`: `{"tokens": [...], "patterns": [layer][head][query][key]}`)."""

    def __init__(self, frames: Mapping[str, pd.DataFrame], attention: dict | None = None, title: str = "lenskit view"):
        if not frames and attention is None:
            raise ValueError("a view needs at least one lens table or the attention patterns")
        self.frames = dict(frames)
        self.attention = attention
        self.title = title

    @classmethod
    def from_prompt(cls, model: "HookedTransformer", prompt: str, lenses: Mapping[str, "Lens"] | None = None, *,
                    top_k: int = 5, attention: bool = True) -> "View":
        """Run `prompt` once per lens (default: the logit lens) and once for the attention patterns."""
        import torch

        from lenses import LogitLens
        from lenses.trajectory import Trajectory

        lenses = dict(lenses or {"logit": LogitLens(model)})
        with torch.no_grad():
            frames = {name: Trajectory.from_prompt(lens, prompt, top_k=top_k).to_frame() for name, lens in lenses.items()}
        return cls(frames, attention_patterns(model, prompt) if attention else None, title=f"{model.cfg.name}: {prompt[:60]!r}")

    # ------------------------------------------------------------------ HTML
    def _lens_section(self, name: str, frame: pd.DataFrame) -> str:
        frame = frame[frame["batch"] == 0] if "batch" in frame.columns else frame
        k = 0
        while f"top{k + 1}_token" in frame.columns:
            k += 1
        layers = sorted(frame["layer"].unique(), reverse=True)  # the output at the top, the embeddings at the bottom
        positions = sorted(frame["position"].unique())
        cells = frame.set_index(["layer", "position"])
        inputs = frame[frame["layer"] == layers[-1]].set_index("position")["input_token"]
        rows = []
        for layer in layers:
            tds = []
            for pos in positions:
                row = cells.loc[(layer, pos)]
                p = float(row["top_prob"])
                topk = "\n".join(f"{i}. {_shown(row[f'top{i}_token']):<12} {float(row[f'top{i}_prob']):.3f}" for i in range(1, k + 1))
                hover = f"layer {layer}, position {pos}, input {_shown(inputs[pos])}\n{topk}"
                style = f"background: rgba(8, 48, 107, {p:.3f}); color: {'#fff' if p > 0.55 else '#111'}"
                tds.append(f'<td class="cell" data-layer="{layer}" data-pos="{pos}" data-p="{p:.4f}" style="{style}" '
                           f'title="{html.escape(hover)}">{html.escape(_shown(row["top_token"]))}</td>')
            label = "emb" if layer == 0 else str(layer)
            rows.append(f'<tr><th class="row">{label}</th>{"".join(tds)}</tr>')
        head = "".join(f'<th class="input">{html.escape(_shown(inputs[p]))}</th>' for p in positions)
        return (f'<section class="lens" data-lens="{html.escape(name)}"><h2>{html.escape(name)} lens</h2>'
                f'<p class="note">top-1 token per layer (rows) and input position (columns), shaded by its probability; '
                f'hover a cell for the top {k}, click to pin it</p><table class="grid lens-table">{"".join(rows)}'
                f'<tr><th class="row">input</th>{head}</tr></table><div class="pins"></div></section>')

    def to_html(self, full_page: bool = True) -> str:
        """The view as HTML: a whole page (`full_page`), or the fragment that `_repr_html_` puts in an iframe."""
        data = {"lenses": [{"name": name} for name in self.frames], "attention": None}
        if self.attention is not None:
            n_heads = len(self.attention["patterns"][0]) if self.attention["patterns"] else 0
            data["attention"] = {**self.attention, "n_heads": n_heads}
        payload = json.dumps(data).replace("</", "<\\/")  # nothing in the JSON may close the script tag
        attention = ('<section class="attention"><h2>attention patterns</h2><p class="note">every layer\'s heads '
                     '(rows: layers); click a head for its pattern</p><div class="heads"></div>'
                     '<div class="head-detail"></div></section>') if self.attention is not None else ""
        body = (f'<div class="lkv"><style>{_asset("view.css")}</style><h1 style="font-size:16px">{html.escape(self.title)}</h1>'
                + "".join(self._lens_section(n, f) for n, f in self.frames.items()) + attention
                + f'<div class="tip"></div><script type="application/json" class="lkv-data">{payload}</script>'
                f'<script>{_asset("view.js")}</script></div>')
        if not full_page:
            return body
        return (f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(self.title)}</title></head>'
                f"<body>{body}</body></html>")

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        if path.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"a view is an HTML file; expected a name ending in .html, got {str(path)!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_html(), encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        # An iframe, so that the view's script runs (Jupyter does not run scripts in plain HTML output everywhere)
        # and its style stays its own.
        return (f'<iframe srcdoc="{html.escape(self.to_html())}" style="width: 100%; height: 640px; border: 0" '
                'sandbox="allow-scripts"></iframe>')

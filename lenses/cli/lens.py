"""`lenskit lens PROMPT`: the top-1 token of every layer at every position, as a table, a CSV and a figure.

    lenskit lens "def add(a, b):\\n    return" --out lens.png --csv lens.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lenskit
from lenses.cli.devices import add_device_options, model_options
from lenses.cli.figure_options import add_figure_options, check_figure_output, figure_kwargs
from lenses.spec import SPEC_HELP
from lenses.table import format_table

COLORS = ("prob", "entropy", "kl", "rank")


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    p = subparsers.add_parser(
        name, help="show what each layer predicts for a prompt, through one lens or several",
        description="Read a prompt's residual stream after every block through a lens and show each layer's "
                    "top-1 next-token prediction at every position.",
    )
    p.add_argument("prompt", metavar="PROMPT", help=r"the text to read; write a newline as \n in the shell with $'...'")
    p.add_argument("--model", default="stdlib-gpt2",
                   help="model folder (a Hugging Face layout), embedded model (stdlib-gpt2, stdlib-llama) or hub name; "
                        "default: stdlib-gpt2")
    p.add_argument("--lens", action="append", metavar="SPEC",
                   help=f"the lens, repeatable to draw several one above the other on one colour scale: {SPEC_HELP} "
                        "(default: logit)")
    p.add_argument("--top-k", type=int, default=5, metavar="K", help="top-k tokens kept per cell for the CSV and hover (default 5)")
    p.add_argument("--out", metavar="FILE", help="write the heatmap to FILE.html (plotly.js inlined, about 5 MB, opens "
                                                 "offline), .png (300 dpi with --size), .svg or .pdf")
    p.add_argument("--csv", metavar="FILE", help="write one row per (layer, position) to FILE")
    p.add_argument("--html", metavar="FILE", help="write an interactive view to FILE.html: each lens's table (hover for the "
                                                  "top-k, click to pin) and the attention patterns; opens offline")
    p.add_argument("--color", choices=COLORS, default="prob",
                   help="heatmap colour: top-1 prob, entropy, KL(final||lens) or rank of the next token (default prob)")
    add_device_options(p)
    add_figure_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import pandas as pd
    import torch

    from lenses.spec import load_lenses
    from lenses.trajectory import Trajectory
    from lenskit.io.files import check_output_file, open_output

    if args.top_k < 1:
        raise ValueError(f"--top-k must be at least 1, got {args.top_k}")
    options = model_options(args)
    # Outputs before any work: a path that cannot take the file, or no browser for a PNG, is an error now.
    if args.csv:
        check_output_file(args.csv, "the --csv table", pipe_ok=True)
    if args.html:
        if Path(args.html).suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"--html writes an HTML view; expected a name ending in .html, got {args.html!r}")
        check_output_file(args.html, "the --html view")
    check_figure_output(args.out)
    model = lenskit.HookedTransformer.from_pretrained(args.model, **options)
    if model.tokenizer is None:
        raise ValueError(f"the model at {args.model} has no tokenizer files, so PROMPT cannot be tokenized")
    lenses = load_lenses(list(dict.fromkeys(args.lens or ["logit"])), model)
    with torch.no_grad():
        trajs = {name: Trajectory.from_prompt(lens, args.prompt, top_k=min(args.top_k, model.cfg.d_vocab))
                 for name, lens in lenses.items()}
    frames = {name: traj.to_frame() for name, traj in trajs.items()}
    frame = next(iter(frames.values())) if len(frames) == 1 else pd.concat(
        [f.assign(lens=name) for name, f in frames.items()], ignore_index=True)
    # Files first, so that `lenskit lens ... | head` still writes them.
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open_output(args.csv, "the --csv table", pipe_ok=True) as f:
            # CRLF rows (RFC 4180, the csv module's default): only then does the writer quote a token that is a bare
            # "\r", at which a reader would otherwise split the row.
            frame.to_csv(f, index=False, lineterminator="\r\n")
    if args.out:
        from lenses import plots

        if len(frames) == 1:
            name = next(iter(frames))
            fig = plots.logit_lens_heatmap(frames[name], color=args.color, title=args.title or f"{name} lens", **figure_kwargs(args))
        else:
            options = figure_kwargs(args)
            sizes = {k: options.pop(k) for k in ("size", "width", "height") if k in options}
            fig = plots.lens_stack(frames, color=args.color, title=args.title, **sizes, **options)
        plots.save_figure(fig, args.out)  # FigureExportError (an OSError): one line, exit 2
    for name, traj in trajs.items():
        print(f"{name} lens, {model.cfg.name}: top-1 prediction after each block "
              f"(layer 0 = embeddings, layer {traj.n_layers} = the model's output)")
        print(format_table(frames[name]))
    if args.html:
        from lenses.view import View, attention_patterns

        View(frames, attention_patterns(model, args.prompt), title=f"{model.cfg.name}: {args.prompt[:60]!r}").save(args.html)
        print(f"wrote {args.html}")
    if args.csv:
        print(f"wrote {args.csv} ({len(frame)} rows)")
    if args.out:
        print(f"wrote {args.out}")
    return 0

"""`lenskit lens PROMPT`: the top-1 token of every layer at every position, as a table, a CSV and a figure.

    lenskit lens "def add(a, b):\\n    return" --out lens.png --csv lens.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lenskit
from lenses.table import format_table
from lenses.cli.figure_options import add_figure_options, figure_kwargs

OUT_SUFFIXES = (".html", ".png", ".svg", ".pdf")
COLORS = ("prob", "entropy", "kl", "rank")


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    p = subparsers.add_parser(
        name, help="show what each layer predicts for a prompt (logit or tuned lens)",
        description="Read a prompt's residual stream after every block through a lens and show each layer's "
                    "top-1 next-token prediction at every position.",
    )
    p.add_argument("prompt", metavar="PROMPT", help=r"the text to read; write a newline as \n in the shell with $'...'")
    p.add_argument("--model", default=lenskit.DEFAULT_MODEL,
                   help="model folder (a Hugging Face layout), embedded model (stdlib-gpt2, stdlib-llama) or hub name; "
                        "default: stdlib-gpt2")
    p.add_argument("--lens", default="logit", metavar="logit|FOLDER",
                   help="'logit' for the logit lens, a folder saved by TunedLens.save, or a hub repo id (default: logit)")
    p.add_argument("--top-k", type=int, default=5, metavar="K", help="top-k tokens kept per cell for the CSV and hover (default 5)")
    p.add_argument("--out", metavar="FILE", help="write the heatmap to FILE.html (plotly.js inlined, about 5 MB, opens "
                                                 "offline), .png (300 dpi with --size), .svg or .pdf")
    p.add_argument("--csv", metavar="FILE", help="write one row per (layer, position) to FILE")
    p.add_argument("--color", choices=COLORS, default="prob",
                   help="heatmap colour: top-1 prob, entropy, KL(final||lens) or rank of the next token (default prob)")
    add_figure_options(p)
    p.set_defaults(run=run)


def load_lens(spec: str, model: lenskit.HookedTransformer):
    """'logit' -> LogitLens; a folder -> TunedLens.load(folder, model)."""
    if spec == "logit":
        from lenses.logit import LogitLens

        return LogitLens(model)
    try:
        from lenses.tuned import TunedLens
    except ImportError as e:
        raise ValueError(f"--lens {spec} needs lenses.TunedLens (lenses/tuned.py), which could not be imported: {e}") from e
    try:
        return TunedLens.load(spec, model)  # a folder, or a hub repo id in the local Hugging Face cache
    except FileNotFoundError:
        if Path(spec).is_dir():
            raise
        raise FileNotFoundError(f"--lens {spec!r} is neither 'logit' nor a folder; pass 'logit', a folder written by "
                                "TunedLens.save, or a hub repo id") from None


def run(args: argparse.Namespace) -> int:
    import torch

    from lenses.trajectory import Trajectory

    if args.out and Path(args.out).suffix.lower() not in OUT_SUFFIXES:
        raise ValueError(f"--out {args.out!r}: expected a file name ending in {', '.join(OUT_SUFFIXES)}")
    if args.top_k < 1:
        raise ValueError(f"--top-k must be at least 1, got {args.top_k}")
    if args.model == lenskit.DEFAULT_MODEL and not (Path(args.model) / "config.json").exists():
        raise FileNotFoundError(f"the embedded model is missing at {args.model}; reinstall lenskit or pass --model FOLDER")
    model = lenskit.HookedTransformer.from_pretrained(args.model)
    if model.tokenizer is None:
        raise ValueError(f"the model at {args.model} has no tokenizer files, so PROMPT cannot be tokenized")
    lens = load_lens(args.lens, model)
    with torch.no_grad():
        traj = Trajectory.from_prompt(lens, args.prompt, top_k=min(args.top_k, model.cfg.d_vocab))
    frame = traj.to_frame()
    # Files first, so that `lenskit lens ... | head` still writes them.
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.csv, index=False)
    if args.out:
        from lenses import plots

        fig = plots.logit_lens_heatmap(frame, color=args.color, title=args.title or f"{traj.lens_name} lens",
                                       **figure_kwargs(args))
        try:
            plots.save_figure(fig, args.out)
        except RuntimeError as e:  # e.g. no Chrome for static export
            print(f"lenskit lens: error: {e}", file=sys.stderr)
            return 2
    print(f"{traj.lens_name} lens, {Path(args.model).name or args.model}: top-1 prediction after each block "
          f"(layer 0 = embeddings, layer {traj.n_layers} = the model's output)")
    print(format_table(frame))
    if args.csv:
        print(f"wrote {args.csv} ({len(frame)} rows)")
    if args.out:
        print(f"wrote {args.out}")
    return 0

"""`lenskit eval-lens`: the logit lens and a tuned lens side by side, per layer, on held-out text.

With --card, the per-layer table also goes into the lens folder: under "eval" in its config.json and as
the Evaluation section of its README.md model card (a lenskit lens folder on this disk only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lenskit

DEFAULT_TOKENS = 2 ** 16


def add_parser(subparsers, name: str) -> None:
    p = subparsers.add_parser(name, help="evaluate a tuned lens against the logit lens, per layer", description=__doc__)
    p.add_argument("--model", default=lenskit.DEFAULT_MODEL, help="model folder, embedded model (stdlib-gpt2, stdlib-llama) or hub name (default: stdlib-gpt2)")
    p.add_argument("--lens", required=True, metavar="FOLDER", help="a tuned-lens folder (lenskit's, or tuned-lens' params.pt)")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH", help="held-out text files, folders or .jsonl")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                   help=f"evaluate the first N tokens of --data (default {DEFAULT_TOKENS:,}, or all it holds if less; "
                        "0 = all of it)")
    p.add_argument("--ctx", type=int, default=None, help="window length (default: the model's n_ctx)")
    p.add_argument("--csv", default=None, metavar="FILE", help="write the per-layer table (nats per token and bits per byte)")
    p.add_argument("--card", action="store_true",
                   help="also write the table into the lens folder's README.md model card (and config.json)")
    p.add_argument("--text-field", default="text", help="the JSONL field that holds the text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from lenskit.io.data import load_token_stream

    from ..evaluation import evaluate
    from ..logit import LogitLens
    from ..tuned import TunedLens

    if args.card:
        check_card_folder(Path(args.lens))  # before any work
    model = lenskit.HookedTransformer.from_pretrained(args.model)
    if model.tokenizer is None:
        raise ValueError(f"the model at {args.model} has no tokenizer files; eval-lens needs one to read text")
    tuned = TunedLens.load(args.lens, model)
    stream = load_token_stream(args.data, model.tokenizer, text_field=args.text_field)
    table = evaluate(model, {"logit": LogitLens(model), "tuned": tuned}, stream, tokens=args.tokens or None, ctx=args.ctx,
                     progress=not args.quiet)
    shown = ["layer", "kl_logit", "kl_tuned", "ce_logit", "ce_tuned", "kl_logit_bpb", "kl_tuned_bpb"]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    depth = table.attrs["prediction_depth"]
    print(f"{table.attrs['n_tokens']:,} tokens in {table.attrs['n_windows']} windows; nats per token, *_bpb bits per byte; "
          f"mean prediction depth: logit {depth['logit']:.2f}, tuned {depth['tuned']:.2f} layers")
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    if args.card:
        from ..card import record_eval

        card = record_eval(args.lens, table.to_dict("records"), int(table.attrs["n_tokens"]), stream.provenance.get("sha256"))
        print(f"wrote the table into {card}")
    return 0


def check_card_folder(folder: Path) -> None:
    """--card writes into a lenskit lens folder on this disk, never into the hub cache or a tuned-lens import."""
    from ..io import read_config
    from ..tuned import FORMAT

    if not folder.is_dir():
        raise ValueError(f"--card writes into a local lens folder, and {folder} is not one; download the lens "
                         "(e.g. `hf download REPO --local-dir FOLDER`) and pass that folder")
    if read_config(folder).get("format") != FORMAT:
        raise ValueError(f"--card: {folder} is not a lenskit lens folder (a tuned-lens import?); save it with "
                         "TunedLens.save first")

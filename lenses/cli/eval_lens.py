"""`lenskit eval-lens`: lenses side by side, per layer, on held-out text.

    lenskit eval-lens --lens runs/tuned_lens --data heldout/            # the logit lens against a tuned lens
    lenskit eval-lens --lens logit --lens tuned:T --lens jacobian:J --lens patchscope --data heldout/ \\
        --table zoo.csv --out zoo.png

The logit lens is always evaluated, as the baseline, first unless named. Every lens reads the same windows;
the intervals are 95% bootstrap intervals over windows. With --card, the per-layer table also goes into the
lens folder: under "eval" in its config.json and as the Evaluation section of its README.md model card (one
lenskit tuned-lens folder on this disk only). Ctrl-C, SIGTERM, SIGHUP or SIGUSR1 stop it in one line (exit 128 +
the signal's number) with the card as it was, or as written whole; the evaluation has no resume: rerun it.

Under torchrun the ranks score disjoint windows (NCCL on GPUs, gloo on CPU) and rank 0 prints and writes the
tables, which are one process's up to float rounding:

    torchrun --nproc-per-node 4 -m lenses.cli eval-lens --lens runs/tuned_lens --data heldout/ --csv table.csv
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import lenskit
from lenses.spec import SPEC_HELP

DEFAULT_TOKENS = 2 ** 16
PLOT_LABELS = {"kl": "KL(final ‖ lens), nats", "ce": "cross-entropy, nats", "entropy": "entropy, nats",
               "top1_agree": "top-1 agreement with the model", "settled": "share of tokens settled"}


def add_parser(subparsers, name: str) -> None:
    p = subparsers.add_parser(name, help="evaluate lenses side by side, per layer", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stdlib-gpt2", help="model folder, embedded model (stdlib-gpt2, stdlib-llama) or hub name (default: stdlib-gpt2)")
    p.add_argument("--lens", required=True, action="append", metavar="SPEC",
                   help=f"a lens, repeatable: {SPEC_HELP} (a FOLDER is a tuned or Jacobian lens, or tuned-lens' params.pt)")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH", help="held-out text files, folders or .jsonl")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                   help=f"evaluate the first N tokens of --data (default {DEFAULT_TOKENS:,}, or all it holds if less; "
                        "0 = all of it)")
    p.add_argument("--ctx", type=int, default=None, help="window length (default: the model's n_ctx)")
    p.add_argument("--csv", default=None, metavar="FILE", help="write the per-layer table, lenses side by side in columns "
                                                                "(kl_logit, kl_tuned, ...; nats per token and bits per byte)")
    p.add_argument("--table", default=None, metavar="FILE", help="write the tidy table: one row per (lens, layer) with "
                                                                 "95%% bootstrap intervals over windows and prediction depth")
    p.add_argument("--out", default=None, metavar="FILE", help="draw a metric per layer, one line per lens with its interval "
                                                               "(.html, .png, .svg or .pdf)")
    p.add_argument("--plot-metric", default="kl", choices=("kl", "ce", "entropy", "top1_agree", "settled"),
                   help="the metric --out draws (default kl, on a log axis)")
    p.add_argument("--card", action="store_true",
                   help="also write the table into the tuned-lens folder's README.md model card (and config.json)")
    p.add_argument("--text-field", default="text", help="the JSONL field that holds the text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from .layer_transfer import add_arguments
    add_arguments(p)  # --layer-transfer, --layer-transfer-out
    from .devices import add_device_options
    add_device_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lenskit.io.files import check_output_file

    from ..spec import split_spec
    from ..training.lock import folder_lock
    from .figure_options import check_figure_output

    specs = list(dict.fromkeys(args.lens))
    if "logit" not in specs:
        specs.insert(0, "logit")  # the baseline every lens is read against
    # Every output before any work: a path that cannot take its file, or no browser for a PNG, is an error now.
    for path, what in ((args.csv, "the --csv table"), (args.table, "the --table table")):
        if path:
            check_output_file(path, what, pipe_ok=True)
    check_figure_output(args.out)
    card_folder = None
    if args.card:
        folders = [arg or spec for spec in specs for kind, arg in [split_spec(spec)] if kind in ("", "tuned")]
        if len(folders) != 1:
            raise ValueError(f"--card writes into one tuned-lens folder; got {len(folders)} lens folders among --lens")
        card_folder = Path(folders[0])
        check_card_folder(card_folder)  # before any work
    from ..training import init_distributed

    rank, world, device = init_distributed()
    from .devices import model_options

    device = model_options(args, device, announce=rank == 0)["device"]  # --dtype checked too
    # --card holds the lens folder's lock from before the lens is read until its card is written, so a
    # train-lens run cannot change the weights between the evaluation and the card (lenses/training/lock.py).
    # Only rank 0 writes, so only rank 0 locks.
    with folder_lock(card_folder) if card_folder is not None and rank == 0 else contextlib.nullcontext():
        code = evaluate(args, specs, card_folder, rank, device)
    if world > 1:
        from ..training import finish_distributed

        finish_distributed()
    return code


def evaluate(args: argparse.Namespace, specs: list[str], card_folder: Path | None, rank: int = 0, device=None) -> int:
    import pandas as pd

    from lenskit.io.data import load_token_stream
    from lenskit.io.files import open_output

    from ..evaluation import evaluate_windows, heldout_windows, per_layer, side_by_side
    from ..spec import load_lenses

    model = lenskit.HookedTransformer.from_pretrained(args.model, device=device, dtype=args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"the model at {args.model} has no tokenizer files; eval-lens needs one to read text")
    lenses = load_lenses(specs, model)
    stream = load_token_stream(args.data, model.tokenizer, text_field=args.text_field)
    windows = heldout_windows(stream, args.tokens or None, args.ctx or model.cfg.n_ctx, model.cfg.n_ctx)
    if (args.layer_transfer or args.layer_transfer_out) and rank == 0:  # first: a lens it cannot read is refused before any work
        from .layer_transfer import run_layer_transfer
        run_layer_transfer(args, model, lenses, windows)
    tidy = evaluate_windows(model, lenses, windows, progress=not args.quiet)  # under torchrun: every rank's windows
    if rank != 0:
        return 0  # rank 0 prints and writes
    table = per_layer(tidy, n_tokens=len(stream), n_bytes=stream.n_bytes)
    n_tokens = int(windows.numel())
    labels = list(lenses)
    shown = ["layer", *(f"kl_{n}" for n in labels), *(f"ce_{n}" for n in labels)]
    with pd.option_context("display.width", 200, "display.max_columns", 40):
        print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    summary = side_by_side(tidy)
    depth = summary.drop_duplicates("lens").set_index("lens")
    print(f"{n_tokens:,} tokens in {len(windows)} windows; nats per token. Mean prediction depth (layers, 95% interval "
          "over windows): " + ", ".join(f"{n} {depth.loc[n, 'prediction_depth']:.2f} [{depth.loc[n, 'prediction_depth_lo']:.2f}, "
                                         f"{depth.loc[n, 'prediction_depth_hi']:.2f}]" for n in labels))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open_output(args.csv, "the --csv table", pipe_ok=True) as f:
            table.to_csv(f, index=False)
        print(f"wrote {args.csv}")
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        with open_output(args.table, "the --table table", pipe_ok=True) as f:
            summary.to_csv(f, index=False)
        print(f"wrote {args.table} ({len(summary)} rows)")
    if args.out:
        from .. import plots

        m = args.plot_metric
        curves = summary[["lens", "layer", m, f"{m}_lo", f"{m}_hi"]].rename(columns={m: "mean", f"{m}_lo": "lo", f"{m}_hi": "hi"})
        fig = plots.layer_curves(curves, m, series="lens", ylabel=PLOT_LABELS[m], log_y=m == "kl",
                                 title=f"lenses on {model.cfg.name}, {n_tokens:,} tokens")
        plots.save_figure(fig, args.out)
        print(f"wrote {args.out}")
    if card_folder is not None:
        from ..card import record_eval
        from ..stopping import deferred_stops

        label = next(n for n in labels if n != "logit")
        records = table.rename(columns=lambda c: c.replace(f"_{label}", "_tuned") if c.startswith(("kl_", "ce_")) else c)
        with deferred_stops():  # config.json and README.md together: a stop signal waits for both
            card = record_eval(card_folder, records.to_dict("records"), n_tokens, stream.provenance.get("sha256"))
            print(f"wrote the table into {card}")
    return 0


def check_card_folder(folder: Path) -> None:
    """--card writes into a lenskit lens folder on this disk, never into the hub cache or a tuned-lens import."""
    from ..card import CARD_FILE
    from ..io import CONFIG_FILE, read_config
    from ..training.lock import check_writable
    from ..tuned import FORMAT

    if not folder.is_dir():
        raise ValueError(f"--card writes into a local lens folder, and {folder} is not one; download the lens "
                         "(e.g. `hf download REPO --local-dir FOLDER`) and pass that folder")
    if read_config(folder).get("format") != FORMAT:
        raise ValueError(f"--card: {folder} is not a lenskit lens folder (a tuned-lens import?); save it with "
                         "TunedLens.save first")
    check_writable(folder)  # a read-only folder is refused now, not after the evaluation
    for name in (CONFIG_FILE, CARD_FILE):
        if (folder / name).exists() and not os.access(folder / name, os.W_OK):
            raise PermissionError(f"--card: {folder / name} is read-only; expected a lens folder this user can write "
                                  "(copy the folder, or fix its permissions)")

"""`lenskit eval-lens ... --layer-transfer FILE.csv [--layer-transfer-out FILE]`: the tuned lens's layer-transfer
matrix (`lenses.transfer`), each translator applied to every stream, on the evaluation's own windows.

eval-lens calls `add_arguments(parser)` and, when either flag is given, `run_layer_transfer(...)` before its
own evaluation, so that a lens the matrix cannot be made from is refused before any work. Imports nothing
heavy at module level: building the parser must not import torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch

    from lenskit import HookedTransformer

    from ..base import Lens

FIGURE_SUFFIXES = (".html", ".png", ".svg", ".pdf")


def _csv_file(text: str) -> str:
    if Path(text).suffix.lower() != ".csv":
        raise argparse.ArgumentTypeError(f"expected a file name ending in .csv, got {text!r}")
    return text


def _figure_file(text: str) -> str:
    if Path(text).suffix.lower() not in FIGURE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"expected a file name ending in {', '.join(FIGURE_SUFFIXES)}, got {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layer transfer (a tuned lens among --lens)")
    g.add_argument("--layer-transfer", type=_csv_file, default=None, metavar="FILE.csv",
                   help="also write the [translator, stream] matrix of mean KL(final ‖ lens) with translator i applied "
                        "to stream j, on the same windows (the diagonal is the lens's own KL)")
    g.add_argument("--layer-transfer-out", type=_figure_file, default=None, metavar="FILE",
                   help="draw its transfer penalty, KL minus that of the stream's own translator, as a heatmap "
                        "(.html, .png, .svg or .pdf)")


def tuned_among(lenses: "Mapping[str, Lens]") -> "Lens":
    """The one tuned lens among the --lens lenses; a one-line ValueError when there is none or several."""
    from ..tuned import TunedLens

    tuned = [label for label, lens in lenses.items() if isinstance(lens, TunedLens)]
    if len(tuned) == 1:
        return lenses[tuned[0]]
    if not tuned:
        raise ValueError(f"--layer-transfer applies a tuned lens's translators to every stream, and no --lens is a tuned "
                         f"lens (got {', '.join(lenses)}); pass --lens FOLDER (or tuned:FOLDER) of a tuned lens")
    raise ValueError(f"--layer-transfer reads one tuned lens, and --lens gives {len(tuned)} ({', '.join(tuned)}); "
                     "run it once per lens")


def run_layer_transfer(args: argparse.Namespace, model: "HookedTransformer", lenses: "Mapping[str, Lens]",
                       windows: "torch.Tensor") -> None:
    """Make the matrix on `windows` [n_windows, ctx], print it, write --layer-transfer and --layer-transfer-out."""
    import pandas as pd

    from ..transfer import layer_transfer, transfer_penalty

    tuned = tuned_among(lenses)
    matrix = layer_transfer(model, tuned, windows, progress=not args.quiet)
    with pd.option_context("display.width", 200, "display.max_columns", 64):
        print(matrix.to_string(float_format=lambda x: f"{x:.4f}"))
    print(f"layer transfer: mean KL(final ‖ lens) in nats per token, translator i (rows) reading stream j (columns), "
          f"{matrix.attrs['n_tokens']:,} tokens; the diagonal is the lens's own KL")
    if args.layer_transfer:
        Path(args.layer_transfer).parent.mkdir(parents=True, exist_ok=True)
        matrix.to_csv(args.layer_transfer, float_format="%.6g")
        print(f"wrote {args.layer_transfer}")
    if args.layer_transfer_out:
        from .. import plots

        fig = plots.transfer_heatmap(transfer_penalty(matrix),
                                     title=f"layer transfer penalty, {model.cfg.name}, {matrix.attrs['n_tokens']:,} tokens")
        plots.save_figure(fig, args.layer_transfer_out)
        print(f"wrote {args.layer_transfer_out}")

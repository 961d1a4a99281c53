"""Tuned lens vs logit lens on the embedded model: train a tuned lens on the model's own training split of
the standard library, then compare both lenses per layer on the held-out files.

    python experiments/tuned_vs_logit.py                  # ~ a few minutes on 2 CPU cores

Writes docs/figures/tuned_vs_logit.csv (one row per layer: kl/ce/entropy for both lenses, nats per
token and bits per byte), the figure as .png/.svg/.pdf, and the lens itself in runs/tuned_lens/
(rerunning resumes or reuses it). The split is `train_default_model`'s: held-out files are the
ones the model never trained on.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
import lenskit  # noqa: E402
from lenses import LogitLens, TunedLens, plots  # noqa: E402
from lenses.evaluation import evaluate_windows, per_layer  # noqa: E402
from lenses.training import Recipe, train  # noqa: E402
from lenskit.io.data import is_heldout, load_token_stream, stdlib_files  # noqa: E402


def split_paths(stride: int) -> tuple[list[Path], list[Path]]:
    """(every `stride`-th training file in sorted order, every held-out file): the model's own split."""
    files = stdlib_files()
    train_files = [p for rel, p in files if not is_heldout(rel)]
    heldout = [p for rel, p in files if is_heldout(rel)]
    return train_files[::stride], heldout


# The recipe of runs/tuned_lens: every experiment that reads that lens trains it this way when it is missing.
LENS_RECIPE = dict(stride=8, steps=120, tokens_per_step=2048, seed=0)


def trained_lens(model: lenskit.HookedTransformer, folder: str | Path, stride: int = LENS_RECIPE["stride"],
                 steps: int = LENS_RECIPE["steps"], tokens_per_step: int = LENS_RECIPE["tokens_per_step"],
                 seed: int = LENS_RECIPE["seed"]) -> TunedLens:
    """The tuned lens in `folder`, trained there on every `stride`-th training file first if it is not (or
    resumed, or refused when the folder holds a run of another recipe)."""
    train_paths, _ = split_paths(stride)
    t0 = time.time()
    train_stream = load_token_stream(train_paths, model.tokenizer)
    print(f"train: {len(train_paths)} files, {len(train_stream):,} tokens ({time.time() - t0:.0f} s to tokenize)", flush=True)
    t0 = time.time()
    tuned = train(TunedLens(model), train_stream, Recipe(steps=steps, tokens_per_step=tokens_per_step, seed=seed), out=folder)
    print(f"tuned lens: {tuned.info['steps_done']} steps, {tuned.info['tokens_seen']:,} tokens, "
          f"{time.time() - t0:.0f} s (0 s if reused from {folder})", flush=True)
    return tuned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL)
    ap.add_argument("--lens", default=str(ROOT / "runs" / "tuned_lens"), help="lens folder (resumed or reused)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="where the CSV and figures go")
    ap.add_argument("--stride", type=int, default=LENS_RECIPE["stride"],
                    help="train on every N-th training file (default 8: ~1/8 of it)")
    ap.add_argument("--steps", type=int, default=LENS_RECIPE["steps"])
    ap.add_argument("--tokens-per-step", type=int, default=LENS_RECIPE["tokens_per_step"])
    ap.add_argument("--eval-windows", type=int, default=96, help="held-out windows of n_ctx tokens to evaluate")
    ap.add_argument("--seed", type=int, default=LENS_RECIPE["seed"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=["png", "svg", "pdf"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = lenskit.HookedTransformer.from_pretrained(args.model)
    tuned = trained_lens(model, args.lens, args.stride, args.steps, args.tokens_per_step, args.seed)
    _, heldout_paths = split_paths(args.stride)
    heldout_stream = load_token_stream(heldout_paths, model.tokenizer)
    print(f"held-out: {len(heldout_paths)} files, {len(heldout_stream):,} tokens", flush=True)

    ctx = model.cfg.n_ctx
    windows = heldout_stream.windows(ctx)
    pick = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed))[: args.eval_windows]
    windows = windows[pick.sort().values]
    tidy = evaluate_windows(model, {"logit": LogitLens(model), "tuned": tuned}, windows)
    table = per_layer(tidy, n_tokens=len(heldout_stream), n_bytes=heldout_stream.n_bytes)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "tuned_vs_logit.csv", index=False, float_format="%.6g")
    # The last stream is the model's own output (KL 0 for both lenses), which a log axis cannot show.
    fig = plots.layer_curves(tidy[tidy.layer < model.cfg.n_layers], "kl", series="lens", unit="window", log_y=True,
                             ylabel="KL(final || lens), nats per token",
                             title=f"Held-out stdlib, {len(windows) * ctx:,} tokens (95% CI over windows)")
    plots.save_figures({"tuned_vs_logit": fig}, out, args.formats)

    shown = ["layer", "kl_logit", "kl_tuned", "ce_logit", "ce_tuned", "kl_logit_bpb", "kl_tuned_bpb", "ce_logit_bpb",
             "ce_tuned_bpb"]
    with pd.option_context("display.width", 200):
        print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    depth = table.attrs["prediction_depth"]
    print(f"nats per token (bits per byte in *_bpb); {len(windows)} held-out windows x {ctx} tokens; "
          f"mean prediction depth: logit {depth['logit']:.2f}, tuned {depth['tuned']:.2f} layers")
    below_last = table[table.layer < model.cfg.n_layers]
    better = bool((below_last.kl_tuned < below_last.kl_logit).all())
    print(f"tuned KL < logit KL at every layer below the last: {better}")
    print(f"wrote {out / 'tuned_vs_logit.csv'} and tuned_vs_logit.{{{','.join(args.formats)}}}")
    if not better:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Causal fidelity on the embedded model (Belrose et al. 2023): do the directions the tuned lens relies on at a
stream matter to the model too? For each stream, the first k directions of the lens's causal basis, each
mean-ablated alone, once from the lens's input and once in the model's own forward; Spearman's rho between
the two influences across directions, with a 95% bootstrap interval over held-out windows. With --baseline
the logit lens is measured the same way.

    python experiments/causal_fidelity.py                 # ~ a few minutes on 2 CPU cores
    python experiments/causal_fidelity.py --baseline      # and the logit lens (twice as long)

The bases are extracted on --fit-windows held-out windows and measured on --eval-windows others, so the
interval is over windows the bases never saw (it does not cover the extraction's own randomness). Uses
the tuned lens experiments/tuned_vs_logit.py trains into runs/tuned_lens (trained here, with the same
recipe, when it is missing). Writes docs/figures/causal_fidelity.csv (one row per lens and stream: rho,
lo, hi), causal_fidelity_directions.csv (one row per direction: both influences, nats) and the figures
causal_fidelity (rho by stream) and causal_fidelity_scatter (the tuned lens's directions).
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
from tuned_vs_logit import LENS_RECIPE, split_paths, trained_lens  # noqa: E402

import lenskit  # noqa: E402
from lenses import LogitLens, metrics, plots  # noqa: E402
from lenses.causal import extract_causal_bases, influence_windows, stream_hiddens  # noqa: E402
from lenskit.io.data import load_token_stream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL)
    ap.add_argument("--lens", default=str(ROOT / "runs" / "tuned_lens"), help="tuned-lens folder (trained there if missing)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="where the CSVs and figures go")
    # With 8 directions rho moved by up to 0.2 between thread counts and window draws; with 12 it moved by 0.05.
    ap.add_argument("--k", type=int, default=12, help="causal-basis directions per stream (default 12)")
    ap.add_argument("--fit-windows", type=int, default=4, help="held-out windows of n_ctx tokens to extract the bases on")
    ap.add_argument("--eval-windows", type=int, default=8, help="other held-out windows to measure the influences on")
    ap.add_argument("--max-iter", type=int, default=15, help="L-BFGS iterations per direction (default 15)")
    ap.add_argument("--baseline", action="store_true", help="also measure the logit lens (doubles the runtime)")
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0, help="which held-out windows (and the bootstrap's draws)")
    # One thread: the matmuls are small (d_model 192), and two threads on two busy cores ran 3-5x slower than one.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", nargs="+", default=["png", "svg", "pdf"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()

    model = lenskit.HookedTransformer.from_pretrained(args.model)
    tuned = trained_lens(model, args.lens, **LENS_RECIPE)
    _, heldout_paths = split_paths(LENS_RECIPE["stride"])
    heldout = load_token_stream(heldout_paths, model.tokenizer)
    ctx = model.cfg.n_ctx
    windows = heldout.windows(ctx)
    pick = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed))
    fit = windows[pick[: args.fit_windows].sort().values]
    measure = windows[pick[args.fit_windows: args.fit_windows + args.eval_windows].sort().values]
    print(f"held-out: {len(heldout):,} tokens; bases from {len(fit)} windows, influences on {len(measure)} others "
          f"({len(measure) * ctx:,} tokens); k={args.k}, L-BFGS iterations <= {args.max_iter}", flush=True)

    summary, directions = [], []
    lenses = {"tuned": tuned, **({"logit": LogitLens(model)} if args.baseline else {})}
    for name, lens in lenses.items():
        for layer in range(model.cfg.n_layers):  # stream n_layers is the model's output: the lens is the model there
            t0 = time.time()
            basis = extract_causal_bases(lens, stream_hiddens(model, fit, layer), args.k, stream=layer,
                                         max_iter=args.max_iter)
            tidy = influence_windows(model, lens, measure, basis)
            ci = metrics.bootstrap_spearman(tidy, "lens_influence", "model_influence", over="direction", unit="window",
                                            n_boot=args.n_boot, seed=args.seed)
            summary.append({"lens": name, "stream": layer, **ci})
            means = tidy.groupby("direction")[["lens_influence", "model_influence"]].mean().reset_index()
            directions.append(means.assign(lens=name, stream=layer, energy=basis.energies.numpy()))
            print(f"{name:5s} stream {layer}: rho {ci['rho']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}]  "
                  f"lens influence {means.lens_influence.min():.3f}-{means.lens_influence.max():.3f}, model "
                  f"{means.model_influence.min():.3f}-{means.model_influence.max():.3f} nats ({time.time() - t0:.0f} s)",
                  flush=True)

    summary = pd.DataFrame(summary)
    directions = pd.concat(directions, ignore_index=True)[["lens", "stream", "direction", "energy", "lens_influence",
                                                             "model_influence"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary.to_csv(out / "causal_fidelity.csv", index=False, float_format="%.6g")
    directions.to_csv(out / "causal_fidelity_directions.csv", index=False, float_format="%.6g")
    figures = {
        "causal_fidelity": plots.fidelity_curves(
            summary, title=f"Causal fidelity, {args.k} directions per stream (95% CI over {len(measure)} windows)"),
        "causal_fidelity_scatter": plots.fidelity_scatter(
            directions[directions.lens == "tuned"], title="Tuned lens: each direction's influence, lens vs model"),
    }
    plots.save_figures(figures, out, args.formats)

    with pd.option_context("display.width", 200):
        print(summary.pivot(index="stream", columns="lens", values="rho").to_string(float_format=lambda x: f"{x:+.3f}"))
    by_lens = summary.groupby("lens", sort=False)["rho"].mean()
    print("mean rho over streams: " + ", ".join(f"{n} {r:+.3f}" for n, r in by_lens.items())
          + f"; {time.time() - start:.0f} s in all")
    print(f"wrote {out / 'causal_fidelity.csv'}, causal_fidelity_directions.csv and "
          f"{{causal_fidelity,causal_fidelity_scatter}}.{{{','.join(args.formats)}}}")


if __name__ == "__main__":
    main()

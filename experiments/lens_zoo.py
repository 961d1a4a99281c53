"""Four lenses side by side on the embedded model: logit, tuned, Jacobian and patchscope, on the same held-out
tokens and the same metrics.

    python experiments/lens_zoo.py                  # ~ a few minutes on 2 CPU cores

The tuned lens is `experiments/tuned_vs_logit.py`'s (runs/tuned_lens, trained here the same way if missing).
The Jacobian lens is fitted on prompts from the model's own training split (runs/jacobian_lens, resumed or
reused). The patchscope reads each stream through the identity prompt "cat -> cat\\n1135 -> 1135\\nhello ->
hello\\n?", patched at the same layer. Writes docs/figures/lens_zoo.csv (one row per lens and layer: each
metric's mean with a 95% bootstrap interval over windows, and prediction depth), lens_zoo.{png,svg,pdf}
(KL and top-1 agreement per layer) and lens_zoo_heatmap.{png,...} (one prompt through the four lenses).
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
from tuned_vs_logit import split_paths  # noqa: E402

import lenskit  # noqa: E402
from lenses import JacobianLens, LogitLens, Patchscope, Trajectory, TunedLens, plots  # noqa: E402
from lenses.evaluation import evaluate_windows, side_by_side  # noqa: E402
from lenses.training import Recipe, train  # noqa: E402
from lenskit.io.data import load_token_stream  # noqa: E402

PROMPT = "def __init__(self, name):\n    self.name = name\n"


def jacobian_prompts(stream, n: int, length: int, seed: int) -> torch.Tensor:
    """n windows of `length` tokens drawn without replacement from the training stream: [n, length]."""
    windows = stream.windows(length)
    pick = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))[:n]
    return windows[pick.sort().values]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL)
    ap.add_argument("--tuned", default=str(ROOT / "runs" / "tuned_lens"), help="tuned-lens folder (trained if missing)")
    ap.add_argument("--jacobian", default=str(ROOT / "runs" / "jacobian_lens"), help="Jacobian-lens folder (fitted if missing)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    ap.add_argument("--stride", type=int, default=8, help="tuned_vs_logit's training split: every N-th training file")
    ap.add_argument("--jacobian-prompts", type=int, default=100, help="prompts the Jacobian lens is fitted on")
    ap.add_argument("--jacobian-length", type=int, default=128, help="tokens per fitting prompt")
    ap.add_argument("--eval-windows", type=int, default=48, help="held-out windows of n_ctx tokens to evaluate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=["png", "svg", "pdf"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = lenskit.HookedTransformer.from_pretrained(args.model)
    train_paths, heldout_paths = split_paths(args.stride)
    train_stream = load_token_stream(train_paths, model.tokenizer)
    heldout_stream = load_token_stream(heldout_paths, model.tokenizer)

    t0 = time.time()
    tuned = train(TunedLens(model), train_stream, Recipe(steps=120, tokens_per_step=2048, seed=args.seed), out=args.tuned)
    print(f"tuned lens: {tuned.info['steps_done']} steps ({time.time() - t0:.0f} s; 0 s if reused from {args.tuned})", flush=True)
    t0 = time.time()
    prompts = jacobian_prompts(train_stream, args.jacobian_prompts, args.jacobian_length, args.seed)
    if (Path(args.jacobian) / "config.json").is_file():
        jacobian = JacobianLens.load(args.jacobian, model)
    else:
        jacobian = JacobianLens.fit(model, prompts, out=args.jacobian, provenance=train_stream.provenance)
    print(f"Jacobian lens: {len(prompts)} prompts of {args.jacobian_length} tokens ({time.time() - t0:.0f} s; "
          f"0 s if reused from {args.jacobian})", flush=True)
    lenses = {"logit": LogitLens(model), "tuned": tuned, "jacobian": jacobian, "patchscope": Patchscope(model)}

    ctx = model.cfg.n_ctx
    windows = heldout_stream.windows(ctx)
    pick = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed))[: args.eval_windows]
    windows = windows[pick.sort().values]
    t0 = time.time()
    tidy = evaluate_windows(model, lenses, windows)
    print(f"evaluated {len(lenses)} lenses on {windows.numel():,} held-out tokens in {time.time() - t0:.0f} s", flush=True)
    table = side_by_side(tidy)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "lens_zoo.csv", index=False, float_format="%.6g")
    below_last = table[table.layer < model.cfg.n_layers]  # the last stream is the model's output: KL 0 for three lenses
    figures = {}
    for metric, label, log_y in (("kl", "KL(final || lens), nats per token", True), ("top1_agree", "top-1 agreement with the model", False)):
        curves = below_last[["lens", "layer", metric, f"{metric}_lo", f"{metric}_hi"]].set_axis(
            ["lens", "layer", "mean", "lo", "hi"], axis=1)
        figures[f"lens_zoo_{metric}"] = plots.layer_curves(
            curves, metric, series="lens", ylabel=label, log_y=log_y,
            title=f"Held-out stdlib, {windows.numel():,} tokens (95% bootstrap CI over windows)")
    with torch.no_grad():
        trajs = {name: Trajectory.from_prompt(lens, PROMPT) for name, lens in lenses.items()}
    figures["lens_zoo_heatmap"] = plots.lens_stack(trajs, color="prob", title="one prompt through four lenses (top-1 token, its probability)")
    plots.save_figures(figures, out, args.formats)

    wide = table.pivot(index="layer", columns="lens", values="kl")[list(lenses)]
    agree = table.pivot(index="layer", columns="lens", values="top1_agree")[list(lenses)]
    with pd.option_context("display.width", 200):
        print("KL(final || lens), nats per token:")
        print(wide.to_string(float_format=lambda x: f"{x:.3f}"))
        print("top-1 agreement with the model:")
        print(agree.to_string(float_format=lambda x: f"{x:.3f}"))
    depth = table.drop_duplicates("lens").set_index("lens")
    print("mean prediction depth (layers, 95% CI): " + ", ".join(
        f"{n} {depth.loc[n, 'prediction_depth']:.2f} [{depth.loc[n, 'prediction_depth_lo']:.2f}, {depth.loc[n, 'prediction_depth_hi']:.2f}]"
        for n in lenses))
    best = wide.loc[wide.index < model.cfg.n_layers].idxmin(axis=1)
    print("lowest KL per layer: " + ", ".join(f"{layer}: {name}" for layer, name in best.items()))
    print(f"wrote {out / 'lens_zoo.csv'} and {', '.join(figures)}.{{{','.join(args.formats)}}}")


if __name__ == "__main__":
    main()

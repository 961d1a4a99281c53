"""Does the residual stream grow with depth, and does GPT-2's 1/sqrt(2N) init keep it level?

    python experiments/residual_growth.py [--model lenskit/default_model] [--out docs/figures]

Two measurements, both the RMS of the stream's entries after 0..n_layers blocks:

1. Fresh random GPT-2s of growing depth (6, 12, 24, 48 blocks; d_model 128), each built twice from
   the same seed: with GPT-2's init, where the two projections that write into the stream get std
   0.02 / sqrt(2 n_layers), and without that scaling (std 0.02 everywhere). Every block adds two
   roughly independent writes, so without the scaling the stream's variance grows linearly with the
   number of blocks; with it, the 2N writes together add a fixed amount whatever the depth.
2. The embedded model, trained, on held-out standard-library text: how the stream and each write
   grow through a trained network.

Writes residual_growth.csv (random models), residual_growth_trained.csv, and the figures
residual_growth.{png,svg} and residual_growth_trained.{png,svg}; prints the numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stdlib_heldout import heldout_windows  # noqa: E402

import lenskit  # noqa: E402
from lenses import metrics, plots  # noqa: E402
from lenses.anatomy import resid_norms  # noqa: E402
from lenskit.observe.stream import stream_hook_names  # noqa: E402


@torch.no_grad()
def stream_rms(model: lenskit.HookedTransformer, tokens: torch.Tensor) -> pd.DataFrame:
    """Per-window rows of `anatomy.resid_norms` for one model."""
    _, cache = model.run_with_cache(tokens, names_filter=stream_hook_names(model.cfg.n_layers, ("resid_pre", "attn_out", "mlp_out")))
    return resid_norms(cache)


def random_models(depths: list[int], seeds: int, d_model: int, n_heads: int, tokens: torch.Tensor, d_vocab: int) -> pd.DataFrame:
    frames = []
    runs = [(n, scaled, seed) for n in depths for scaled in (True, False) for seed in range(seeds)]
    for n_layers, scaled, seed in tqdm(runs, desc="random models"):
        cfg = lenskit.ModelConfig(n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_vocab=d_vocab,
                                  n_ctx=tokens.shape[1], name=f"random-{n_layers}")
        model = lenskit.HookedTransformer(cfg).eval()
        torch.manual_seed(seed)  # the same weights up to the scaling, so the two inits are paired
        model.init_weights(residual_scaling=scaled)
        rows = stream_rms(model, tokens)
        rows = rows[rows.component == "resid"].assign(
            n_layers=n_layers, init="1/sqrt(2N)" if scaled else "no scaling", seed=seed)
        rows["depth"] = rows["layer"] / n_layers  # streams of models of any depth on one axis, 0..1
        frames.append(rows)
    return pd.concat(frames, ignore_index=True)


def growth_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per depth and init: RMS of the first and last stream (mean over seeds) and their ratio."""
    per_seed = frame.groupby(["init", "n_layers", "seed", "layer"]).rms.mean().reset_index()
    first = per_seed[per_seed.layer == 0].set_index(["init", "n_layers", "seed"]).rms
    last = per_seed.loc[per_seed.groupby(["init", "n_layers", "seed"]).layer.idxmax()].set_index(["init", "n_layers", "seed"]).rms
    table = pd.DataFrame({"rms_embed": first, "rms_final": last, "growth": last / first}).reset_index()
    return table.groupby(["init", "n_layers"])[["rms_embed", "rms_final", "growth"]].mean().reset_index()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL, help="trained model to measure (default: the embedded one)")
    ap.add_argument("--out", default="docs/figures")
    ap.add_argument("--depths", type=int, nargs="+", default=[6, 12, 24, 48])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--windows", type=int, default=16, help="held-out windows per measurement")
    ap.add_argument("--ctx", type=int, default=128, help="tokens per window for the random models")
    ap.add_argument("--formats", default="png,svg")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = lenskit.HookedTransformer.from_pretrained(args.model).eval()
    windows = heldout_windows(model.tokenizer, args.windows, model.cfg.n_ctx, seed=0)

    random = random_models(args.depths, args.seeds, args.d_model, args.heads, windows[:, : args.ctx], model.cfg.d_vocab)
    random.to_csv(out / "residual_growth.csv", index=False)
    trained = stream_rms(model, windows).assign(model=Path(model.cfg.name).name)  # not a machine-specific path
    trained.to_csv(out / "residual_growth_trained.csv", index=False)

    table = growth_table(random)
    pd.set_option("display.width", 120)
    print(f"random GPT-2s, d_model={args.d_model}, {args.seeds} seeds, {args.windows} held-out windows of {args.ctx} tokens")
    print("RMS of the stream's entries: after the embedding, after the last block, and the ratio")
    print(table.pivot(index="n_layers", columns="init", values=["rms_final", "growth"]).round(4).to_string())
    summary = metrics.mean_ci(trained, "rms", by=["component", "layer"], unit="batch")
    resid = summary[summary.component == "resid"][["layer", "mean", "lo", "hi"]]
    print(f"\nthe embedded model ({Path(args.model).name}), trained: stream RMS by layer (mean and 95% CI over {args.windows} windows of {windows.shape[1]} tokens)")
    print(resid.round(4).to_string(index=False))

    fig = plots.growth_curves(random, "rms", x="depth", group="n_layers", style="init", unit="seed",
                              title="Stream RMS at init, with and without the 1/sqrt(2N) scaling")
    fig.update_layout(xaxis_title="depth (stream index / n_layers)", yaxis_title="stream RMS per entry")
    trained_fig = plots.resid_norm_curves(trained, "rms", title="The embedded model, trained: stream and writes by layer", log_y=True)
    plots.save_figures({"residual_growth": fig, "residual_growth_trained": trained_fig}, out, args.formats)
    print(f"\nwrote {out}/residual_growth.csv, residual_growth_trained.csv and figures ({args.formats})")


if __name__ == "__main__":
    main()

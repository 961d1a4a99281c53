"""The two embedded models side by side: a GPT-2 (`stdlib-gpt2`) and a Llama (`stdlib-llama`) trained on the same
tokens with the same budget, read by the same lenses on the same held-out windows.

    python experiments/architectures.py [--windows 96] [--out docs/figures]      # ~ 10 minutes on 2 CPU cores

For each model:

- a tuned lens, trained exactly as `tuned_vs_logit.py` trains the GPT-2's (120 steps of 2,048 tokens from
  every 8th training file, seed 0; lens folders under runs/, reused when rerun);
- logit-lens and tuned-lens KL(final || lens) per layer, and the mean prediction depth of each lens;
- block deletion: the held-out loss change when one block's two writes are zeroed;
- the residual stream's RMS after each block (norm growth).

Every number carries a 95% percentile-bootstrap interval over windows (2,000 resamples, the same draws
for both models, which read the same windows), and each difference llama - gpt2 its own paired interval.
Writes architectures.csv (metric, model, lens, layer, mean, lo, hi) and the figures architectures_kl,
architectures_deletion and architectures_resid (.png/.svg).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from block_deletion import window_losses  # noqa: E402
from stdlib_heldout import heldout_windows  # noqa: E402
from tuned_vs_logit import split_paths  # noqa: E402

import lenskit  # noqa: E402
from lenses import LogitLens, TunedLens, plots  # noqa: E402
from lenses.evaluation import evaluate_windows  # noqa: E402
from lenses.metrics import bootstrap_ci  # noqa: E402
from lenses.training import Recipe, train  # noqa: E402
from lenskit import Stream  # noqa: E402
from lenskit.intervene.interventions import Block, ablation_hooks  # noqa: E402
from lenskit.io.data import load_token_stream  # noqa: E402

MODELS = ("stdlib-gpt2", "stdlib-llama")


@torch.no_grad()
def resid_rms(model: lenskit.HookedTransformer, windows: torch.Tensor, batch: int = 16) -> pd.DataFrame:
    """RMS of the stream's entries after 0..n_layers blocks, per window (mean over its positions)."""
    n = model.cfg.n_layers
    locations = [Stream(l) for l in range(n + 1)]
    rows = []
    for start in range(0, len(windows), batch):
        x = windows[start: start + batch]
        _, cache = model.run_with_cache(x, names_filter=[s.hook_name(n) for s in locations], return_logits=False)
        for l, s in enumerate(locations):
            rms = cache.stream(s).pow(2).mean(-1).sqrt().mean(-1)  # [batch]
            rows += [{"layer": l, "window": start + b, "value": float(v)} for b, v in enumerate(rms)]
    return pd.DataFrame(rows)


def deletion(model: lenskit.HookedTransformer, windows: torch.Tensor) -> pd.DataFrame:
    """Held-out loss change per window when block l is deleted (both writes zeroed)."""
    intact = window_losses(model, windows)
    rows = []
    for l in range(model.cfg.n_layers):
        losses = window_losses(model, windows, ablation_hooks(model, [Block(l)], "zero"))
        rows += [{"layer": l, "window": w, "value": float(d)} for w, d in enumerate(losses - intact)]
    return pd.DataFrame(rows)


def tuned_lens(model: lenskit.HookedTransformer, name: str, steps: int) -> TunedLens:
    train_paths, _ = split_paths(8)
    stream = load_token_stream(train_paths, model.tokenizer)
    folder = ROOT / "runs" / ("tuned_lens" if name == "stdlib-gpt2" else f"tuned_lens_{name}")
    return train(TunedLens(model), stream, Recipe(steps=steps, tokens_per_step=2048, seed=0), out=folder)


def measure(name: str, windows: torch.Tensor, steps: int) -> pd.DataFrame:
    """Every per-window number of one model, long format: metric, lens, layer, window, value."""
    model = lenskit.HookedTransformer.from_pretrained(name)
    tidy = evaluate_windows(model, {"logit": LogitLens(model), "tuned": tuned_lens(model, name, steps)}, windows)
    kl = tidy.rename(columns={"kl": "value"})[["lens", "layer", "window", "value"]].assign(metric="kl")
    n = model.cfg.n_layers
    depth = (tidy[tidy.layer < n].assign(value=lambda d: 1 - d.settled)
             .groupby(["lens", "window"], as_index=False)["value"].sum().assign(metric="prediction_depth", layer=-1))
    frames = [kl, depth, deletion(model, windows).assign(metric="deletion", lens=""),
              resid_rms(model, windows).assign(metric="resid_rms", lens="")]
    return pd.concat(frames, ignore_index=True).assign(model=name.removeprefix("stdlib-"))


def summarise(long: pd.DataFrame) -> pd.DataFrame:
    """Means with bootstrap intervals per (metric, model, lens, layer), plus paired llama - gpt2 differences."""
    keys = ["metric", "lens", "layer"]
    ci = bootstrap_ci(long, "value", by=[*keys, "model"], unit="window")
    paired = long.pivot_table(index=[*keys, "window"], columns="model", values="value").reset_index()
    paired["value"] = paired["llama"] - paired["gpt2"]
    diff = bootstrap_ci(paired.assign(model="llama - gpt2"), "value", by=[*keys, "model"], unit="window")
    return pd.concat([ci, diff], ignore_index=True)[[*keys, "model", "mean", "lo", "hi", "n"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=96, help="held-out windows of n_ctx tokens (the same for both)")
    ap.add_argument("--steps", type=int, default=120, help="tuned-lens training steps per model")
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=["png", "svg"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gpt2 = lenskit.HookedTransformer.from_pretrained(MODELS[0])
    windows = heldout_windows(gpt2.tokenizer, args.windows, gpt2.cfg.n_ctx, seed=0)  # one tokenizer: the same tokens
    long = pd.concat([measure(name, windows, args.steps) for name in MODELS], ignore_index=True)
    table = summarise(long)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "architectures.csv", index=False, float_format="%.6g")

    models = table[table.model != "llama - gpt2"]
    kl = models[(models.metric == "kl") & (models.layer < gpt2.cfg.n_layers)].assign(series=lambda d: d.model + ", " + d.lens)
    figures = {
        "architectures_kl": plots.layer_curves(kl, series="series", log_y=True, ylabel="KL(final || lens), nats per token",
                                               title=f"Same tokens and budget, {args.windows} held-out windows (95% CI)"),
        "architectures_deletion": plots.layer_curves(models[models.metric == "deletion"].rename(columns={"layer": "block"}),
                                                     series="model", x="block",
                                                     ylabel="held-out loss change, nats per token",
                                                     title="Deleting one block (95% CI over windows)"),
        "architectures_resid": plots.layer_curves(models[models.metric == "resid_rms"], series="model",
                                                  ylabel="RMS of the stream's entries",
                                                  title="Stream RMS after each block (95% CI)"),
    }
    plots.save_figures(figures, out, args.formats)
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(table.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    print(f"wrote {out / 'architectures.csv'} and {', '.join(figures)}")


if __name__ == "__main__":
    main()

"""Delete each block, or zero each sublayer, of the embedded model and measure the held-out loss.

    python experiments/block_deletion.py [--model lenskit/default_model] [--windows 64] [--out docs/figures]

"Why can you delete a middle layer from a trained transformer and get only a mild degradation?" This
measures it. Held-out text is the embedded model's own held-out split (stdlib files it never trained
on, `stdlib_heldout.heldout_windows`), cut into n_ctx-token windows. For each block L:

- delete block L (zero both of its writes, so `resid_post[L] == resid_pre[L]`);
- zero only its attention write, or only its MLP write;
- the same three with mean ablation: each write replaced by its mean over a disjoint set of held-out
  windows, which removes the information in the write but not its average offset to the stream.

For scale: the intact model, and the unigram entropy of the scored tokens (the best loss of any model that
ignores context); the table gives each damage as a share of the model's gain over that level. The model
with every block deleted is listed too, but it is no floor: with tied embeddings, the embedding read
straight through the unembedding predicts the current token again, far worse than unigram. Losses are
mean next-token cross-entropy in nats per token; the 95% intervals on each change are over windows,
paired with the intact run.

Writes block_deletion.csv (one row per configuration) and block_deletion.{png,svg}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stdlib_heldout import heldout_windows  # noqa: E402

import lenskit  # noqa: E402
from lenses import metrics, plots  # noqa: E402
from lenskit.intervene.interventions import Attn, Block, Mlp, ablation_hooks  # noqa: E402

KINDS = {"block": Block, "attn": Attn, "mlp": Mlp}
LABELS = {"block": "block deleted", "attn": "attention write", "mlp": "MLP write"}


@torch.no_grad()
def window_losses(model: lenskit.HookedTransformer, windows: torch.Tensor, hooks=(), batch: int = 16) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of each window [n_windows, ctx] -> [n_windows]."""
    out = []
    with model.hooks(hooks):
        for x in windows.split(batch):
            logits = model(x)
            ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="none")
            out.append(ce.view(len(x), -1).mean(1))
    return torch.cat(out)


def run(model: lenskit.HookedTransformer, windows: torch.Tensor, reference: torch.Tensor) -> pd.DataFrame:
    """Per-window losses, long format: config, kind, mode, layer, window, loss, delta (vs intact)."""
    n_layers = model.cfg.n_layers
    configs = [("intact", None, None, [])]
    configs.append(("all blocks deleted", "all", "zero", [Block(i) for i in range(n_layers)]))
    configs += [(f"{kind} {layer} {mode}", kind, mode, [KINDS[kind](layer)])
                for mode in ("zero", "mean") for kind in KINDS for layer in range(n_layers)]
    rows = []
    clean = None
    for name, kind, mode, targets in tqdm(configs, desc="ablations"):
        hooks = ablation_hooks(model, targets, mode, reference=reference) if targets else []
        losses = window_losses(model, windows, hooks)
        clean = losses if clean is None else clean
        layer = int(name.split()[1]) if kind in KINDS else None
        rows += [{"config": name, "kind": kind or "intact", "mode": mode or "none", "layer": layer, "window": w,
                  "loss": float(l), "delta": float(l - c)} for w, (l, c) in enumerate(zip(losses, clean))]
    return pd.DataFrame(rows)


def unigram_entropy(windows: torch.Tensor) -> float:
    """Entropy (nats) of the empirical distribution of the predicted tokens (all but each window's first)."""
    counts = torch.bincount(windows[:, 1:].flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def summarise(per_window: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: mean loss, mean change and its 95% interval over windows."""
    keys = ["config", "kind", "mode", "layer"]
    frame = per_window.fillna({"layer": -1})
    loss = frame.groupby(keys, sort=False)["loss"].mean().rename("loss")
    delta = metrics.mean_ci(frame, "delta", by=keys).set_index(keys)
    table = pd.concat([loss, delta.rename(columns={"mean": "delta", "lo": "delta_lo", "hi": "delta_hi",
                                                   "n": "windows"})], axis=1).reset_index()
    table["layer"] = table["layer"].astype(int).astype("Int64").where(table["layer"] >= 0)
    order = {name: i for i, name in enumerate(per_window["config"].unique())}
    return table.sort_values("config", key=lambda s: s.map(order)).reset_index(drop=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL)
    ap.add_argument("--windows", type=int, default=64, help="held-out windows to score (n_ctx tokens each)")
    ap.add_argument("--reference-windows", type=int, default=32, help="other held-out windows for the means")
    ap.add_argument("--out", default="docs/figures")
    ap.add_argument("--formats", default="png,svg")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = lenskit.HookedTransformer.from_pretrained(args.model).eval()
    both = heldout_windows(model.tokenizer, args.windows + args.reference_windows, model.cfg.n_ctx, seed=0)
    order = torch.randperm(len(both), generator=torch.Generator().manual_seed(1))
    windows, reference = both[order[: args.windows]], both[order[args.windows:]]

    per_window = run(model, windows, reference)
    table = summarise(per_window)
    table.to_csv(out / "block_deletion.csv", index=False)

    intact = table.loc[table.config == "intact", "loss"].item()
    gone = table.loc[table.config == "all blocks deleted", "loss"].item()
    unigram = unigram_entropy(windows)
    print(f"{Path(model.cfg.name).name}: held-out loss over {args.windows} windows of {windows.shape[1]} tokens "
          f"(means over {args.reference_windows} other windows)")
    print(f"intact {intact:.3f} nats/token; unigram entropy of these tokens {unigram:.3f}; "
          f"every block deleted {gone:.3f} (the embedding predicts the current token)")
    shown = table[table.kind.isin(list(KINDS))].copy()
    shown["cell"] = [f"{l:.3f} ({d:+.3f})" for l, d in zip(shown["loss"], shown["delta"])]
    shown["column"] = shown["kind"].map(LABELS) + ", " + shown["mode"]
    grid = shown.pivot(index="layer", columns="column", values="cell")
    cols = [f"{LABELS[k]}, {m}" for m in ("zero", "mean") for k in KINDS]
    print("\nloss with the part removed (change vs intact), nats/token")
    print(grid[cols].to_string())
    gain = unigram - intact
    print(f"\nshare of the model's gain over unigram ({gain:.3f} nats) lost when a block is deleted: "
          + ", ".join(f"{int(r.layer)}: {r.delta / gain:.0%}"
                      for r in shown[(shown.kind == "block") & (shown["mode"] == "zero")].itertuples()))

    bars = shown.assign(part=shown["kind"].map(LABELS), half=(shown["delta_hi"] - shown["delta_lo"]) / 2)
    fig = plots.grouped_bars(bars, x="layer", y="delta", group="part", pattern="mode", error="half", xlabel="block",
                             ylabel="Δ held-out loss (nats/token)", log_y=bool((bars["delta"] > 0).all()),
                             title=f"One part removed (intact {intact:.2f}, unigram {unigram:.2f} nats/token)")
    plots.save_figures({"block_deletion": fig}, out, args.formats)
    print(f"\nwrote {out}/block_deletion.csv and block_deletion.{{{args.formats}}}")


if __name__ == "__main__":
    main()

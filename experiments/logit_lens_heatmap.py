"""The logit lens on the embedded model: one prompt's heatmap, and per-layer statistics over held-out code.

    python experiments/logit_lens_heatmap.py [--model lenskit/default_model] [--out docs/figures]

1. One short Python prompt, read after every block: logit_lens_heatmap.csv (one row per layer and
   position) and logit_lens_heatmap.{png,svg,pdf} (cell = top-1 token, colour = its probability).
2. Held-out standard-library windows the model never trained on: per layer, the KL from the final
   output to the lens (nats), the lens's entropy, how often its top-1 already equals the model's
   final top-1, and the cross-entropy of the true next token, each a mean over windows with a 95%
   interval across windows: logit_lens_layers.csv and logit_lens_layers.{png,svg,pdf}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
import lenskit  # noqa: E402
from lenses import LogitLens, Trajectory, metrics, plots  # noqa: E402
from lenses.table import format_table  # noqa: E402

PROMPT = "def __init__(self, name):\n    self.name = name\n"


def prompt_figure(model, lens, prompt: str, out: Path, formats: list[str]) -> pd.DataFrame:
    frame = Trajectory.from_prompt(lens, prompt, top_k=5).to_frame()
    frame.to_csv(out / "logit_lens_heatmap.csv", index=False)
    fig = plots.logit_lens_heatmap(frame, color="prob", size="page")  # the text width of a paper, 300 dpi
    plots.save_figures({"logit_lens_heatmap": fig}, out, formats)
    print(format_table(frame, width=160))
    return frame


def layer_stats(model, lens, windows: torch.Tensor) -> pd.DataFrame:
    """Rows per (window, layer, position) reduced to per-(window, layer) means."""
    rows = []
    for w, tokens in enumerate(tqdm(windows, desc="held-out windows", file=sys.stderr)):
        frame = Trajectory.from_prompt(lens, tokens[None], top_k=1).to_frame()
        final = frame[frame.layer == frame.layer.max()].set_index("position")["top_token_id"]
        frame["agrees_with_final"] = (frame["top_token_id"].to_numpy() == final.loc[frame["position"]].to_numpy()).astype(float)
        frame = frame[frame.target_rank >= 0]  # the last position has no next token
        frame["ce_next_token"] = -frame["target_logprob"]
        per_layer = frame.groupby("layer")[["kl_to_final", "entropy", "agrees_with_final", "ce_next_token"]].mean()
        rows.append(per_layer.reset_index().assign(window=w))
    return pd.concat(rows, ignore_index=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL)
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="where the CSVs and figures go")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--windows", type=int, default=32, help="held-out windows of --ctx tokens (default 32)")
    ap.add_argument("--ctx", type=int, default=None, help="tokens per window (default: the model's n_ctx)")
    ap.add_argument("--formats", nargs="+", default=["png", "svg", "pdf"], choices=["png", "svg", "pdf", "html"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = lenskit.HookedTransformer.from_pretrained(args.model).eval()
    lens = LogitLens(model)

    print(f"== logit lens on {args.prompt!r}")
    prompt_figure(model, lens, args.prompt, out, args.formats)

    from stdlib_heldout import heldout_windows

    windows = heldout_windows(model.tokenizer, args.windows, args.ctx or model.cfg.n_ctx)
    per_window = layer_stats(model, lens, windows)
    long = per_window.melt(id_vars=["window", "layer"], var_name="statistic", value_name="value")
    summary = pd.concat([metrics.mean_ci(long[long.statistic == s], "value", by="layer").assign(statistic=s)
                         for s in ["kl_to_final", "entropy", "agrees_with_final", "ce_next_token"]], ignore_index=True)
    summary = summary[["statistic", "layer", "mean", "lo", "hi", "n"]]
    summary.to_csv(out / "logit_lens_layers.csv", index=False)
    print(f"\n== per layer, mean over {len(windows)} held-out windows of {windows.shape[1]} tokens (95% CI across windows)")
    print(summary.pivot(index="layer", columns="statistic", values="mean").round(3).to_string())

    nats = summary[summary.statistic.isin(["kl_to_final", "ce_next_token"])].replace(
        {"kl_to_final": "KL(final ‖ lens)", "ce_next_token": "cross-entropy of next token"})
    fig = plots.layer_curves(nats, series="statistic", ylabel="nats per token",
                             title="Logit lens on held-out stdlib code", size="page")
    plots.save_figures({"logit_lens_layers": fig}, out, args.formats)
    print(f"\nwrote {out}/logit_lens_heatmap.{{csv,{','.join(args.formats)}}} and logit_lens_layers.{{csv,{','.join(args.formats)}}}")


if __name__ == "__main__":
    main()

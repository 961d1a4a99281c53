"""A gallery of the shipped SAE's features (`SAE.load("stdlib-gpt2-sae-L3")`): where each fires on held-out text,
and what its decoder direction says through three lenses (logit, tuned, Jacobian) at every stream from 3 on.

    python experiments/sae_gallery.py        # ~ a few minutes on 1 CPU thread (less when the lenses exist)

The tuned lens is `experiments/tuned_vs_logit.py`'s (runs/tuned_lens, trained the same way if missing); the
Jacobian lens `experiments/lens_zoo.py`'s (runs/jacobian_lens, fitted here on fewer prompts if missing).
Features shown: those firing on 0.2%-5% of held-out tokens with the most consistent top token, the strongest
first. Writes docs/figures/sae_gallery.md (the gallery's section, docs/gallery.md), sae_gallery.csv (every reading) and
sae_gallery.{png,...} (the first feature's heatmap through the three lenses).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from lens_zoo import jacobian_prompts
from stdlib_heldout import heldout_windows
from tuned_vs_logit import split_paths, trained_lens

import lenskit
from lenses import JacobianLens, LogitLens, plots
from lenses.features import feature_lens
from lenskit.io.data import load_token_stream
from lenskit.io.text import show_token
from lenskit.saes import SAE
from lenskit.saes.features import Feature, top_activations
from lenskit.saes.formats import embedded_sae_folder


def pick_features(top: pd.DataFrame, n: int) -> list[int]:
    """Features firing on 0.2%..5% of tokens, ranked by how often their top-10 contexts share one token, then by
    their strongest activation."""
    live = top[(top["rate"] >= 0.002) & (top["rate"] <= 0.05)]
    score = live.groupby("feature").agg(same=("token", lambda t: t.value_counts().iloc[0] / len(t)),
                                        peak=("activation", "max"))
    return score.sort_values(["same", "peak"], ascending=False).head(n).index.tolist()


def cell(tokens: pd.Series, k: int = 4) -> str:
    return " ".join(f"`{show_token(str(t), 10)}`" for t in tokens.head(k)).replace("|", "\\|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sae", default="stdlib-gpt2-sae-L3", help="a shipped SAE's short name")
    ap.add_argument("--tuned", default=str(ROOT / "runs" / "tuned_lens"))
    ap.add_argument("--jacobian", default=str(ROOT / "runs" / "jacobian_lens"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    ap.add_argument("--windows", type=int, default=64, help="held-out windows of 128 tokens scanned")
    ap.add_argument("--features", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", nargs="+", default=["png"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")
    sae = SAE.load(args.sae)
    windows = heldout_windows(model.tokenizer, args.windows, 128)
    top = top_activations(model, sae, windows, top=10, context=12)
    chosen = pick_features(top, args.features)
    print(f"{top.feature.nunique()} of {sae.d_sae} features fire on {windows.numel():,} held-out tokens; shown: {chosen}")

    tuned = trained_lens(model, args.tuned)
    if (Path(args.jacobian) / "config.json").is_file():
        jacobian = JacobianLens.load(args.jacobian, model)
    else:
        stream = load_token_stream(split_paths(8)[0], model.tokenizer)
        jacobian = JacobianLens.fit(model, jacobian_prompts(stream, 32, 128, 0), out=args.jacobian,
                                    provenance=stream.provenance, progress=False)
    lenses = {"logit": LogitLens(model), "tuned": tuned, "jacobian": jacobian}
    readings = pd.concat([feature_lens(model, Feature(sae, i), lenses, top_k=5).assign(feature=i) for i in chosen],
                         ignore_index=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    readings.to_csv(out / "sae_gallery.csv", index=False)
    first = readings[readings.feature == chosen[0]].drop(columns="feature")
    first.attrs.update(feature=chosen[0], hook=sae.hook_name, mode="direction")
    plots.save_figures({"sae_gallery": plots.feature_lens_heatmap(first)}, out, args.formats)

    ev = json.loads((embedded_sae_folder(args.sae) / "training.json").read_text())["eval"]
    lines = [f"`SAE.load(\"stdlib-gpt2-sae-L3\")`: {sae.d_sae} latents, k = {sae.cfg.k}, on `{sae.hook_name}` "
             f"(FVU {ev['fvu']:.3f}, CE +{ev['ce_increase']:.3f} nats spliced; card in lenskit/saes/stdlib_gpt2_sae_L3). "
             f"Top held-out contexts (the firing token in **bold**), then the tokens the feature's decoder direction "
             f"promotes at stream 3 and at stream {model.cfg.n_layers - 1} (the last block's input; at stream "
             f"{model.cfg.n_layers} every lens is the model's readout) through each lens "
             "(`experiments/sae_gallery.py`; heatmap of the first: `lenskit features --sae stdlib-gpt2-sae-L3 "
             f"--feature {chosen[0]} --lens logit --lens runs/tuned_lens`).", "",
             f"| feature | fires on | top contexts | logit lens | tuned lens @3 / @{model.cfg.n_layers - 1} "
             f"| Jacobian lens @3 / @{model.cfg.n_layers - 1} |", "|---|---|---|---|---|---|"]
    last = model.cfg.n_layers - 1
    for i in chosen:
        t = top[top.feature == i]
        ctx = " · ".join(f"`…{show_token(c)[-20:]}`**`{show_token(tok, 10)}`**".replace("|", "\\|")
                         for c, tok in zip(t.context.head(2), t.token.head(2)))
        r = readings[(readings.feature == i) & (readings.kind == "promoted")]
        at = lambda lens, layer, r=r: cell(r[(r.lens == lens) & (r.layer == layer)].token, 3)  # noqa: E731
        lines.append(f"| {i} | {t['rate'].iloc[0]:.2%} | {ctx} | {at('logit', 3)} | {at('tuned', 3)} / {at('tuned', last)} "
                     f"| {at('jacobian', 3)} / {at('jacobian', last)} |")
    (out / "sae_gallery.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

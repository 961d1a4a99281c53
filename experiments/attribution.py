"""Direct logit attribution on the embedded model: which writes push the next token up, which push it down.

    python experiments/attribution.py [--prompt TEXT] [--token T] [--minus T] [--out docs/figures]

The prompt ends where Python fixes the next token: after `self.key = key` and `self.value =`, a
model that read the signature should prefer ` value` to ` key`, the name it copied a line before. Each write to the stream (embeddings, every
attention head, every MLP, the final norm's bias) is projected on `W_U[token] - W_U[minus]` through the
final LayerNorm, linearised at the actual stream (its scale held fixed), so the rows sum exactly to
the model's logit difference (`lenses.anatomy.direct_logit_attribution`). A row is a direct effect
only: what a write says to the output, not what it changes in later layers.

Writes attribution.csv, attribution.{png,svg} (per write) and attribution_heads.{png,svg} (per head).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lenskit  # noqa: E402
from lenses import plots  # noqa: E402
from lenses.anatomy import direct_logit_attribution  # noqa: E402

PROMPT = "class Node:\n    def __init__(self, key, value):\n        self.key = key\n        self.value ="


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--token", default=" value", help="the token whose logit is explained (one token)")
    ap.add_argument("--minus", default=" key", help="subtract this token's logit (one token); '' for none")
    ap.add_argument("--out", default="docs/figures")
    ap.add_argument("--formats", default="png,svg")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = lenskit.HookedTransformer.from_pretrained(args.model).eval()
    tokens = model.to_tokens(args.prompt)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=lambda name: True)  # includes hook_result
    minus = args.minus or None
    per_write = direct_logit_attribution(model, cache, args.token, minus)
    per_head = direct_logit_attribution(model, cache, args.token, minus, per_head=True)

    target = f"logit({args.token!r})" + (f" - logit({minus!r})" if minus else "")
    frame = pd.concat([per_write.assign(split="write"), per_head.assign(split="head")], ignore_index=True)
    frame["target"] = target
    frame.to_csv(out / "attribution.csv", index=False)

    probs = logits[0, -1].softmax(-1)
    top = probs.topk(5)
    print(f"prompt ends {args.prompt[-40:]!r}; the model's top-5 next tokens:")
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        print(f"  {model.to_string(torch.tensor([i]))!r:>12} {p:.3f}")
    total = sum(per_write.attribution)
    print(f"\n{target} = {per_write.attrs['logit'][0]:.3f} (model); sum of the attribution rows = {total:.3f}")
    print(per_write[["component", "attribution"]].to_string(index=False, float_format=lambda v: f"{v:+.3f}"))
    heads = per_head[per_head.kind == "head"].reindex(per_head[per_head.kind == "head"].attribution.abs()
                                                     .sort_values(ascending=False).index)
    print("\nlargest heads:")
    print(heads.head(5)[["component", "attribution"]].to_string(index=False, float_format=lambda v: f"{v:+.3f}"))

    bars = plots.attribution_bars(per_write, title=f"Direct logit attribution of {target}")
    grid = plots.head_attribution_heatmap(per_head, title=f"Per head: {target}")
    plots.save_figures({"attribution": bars, "attribution_heads": grid}, out, args.formats)
    print(f"\nwrote {out}/attribution.csv and figures ({args.formats})")


if __name__ == "__main__":
    main()

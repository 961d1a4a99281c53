"""Parameter and FLOP accounting for the GPT-2 family and the embedded model.

    python experiments/accounting.py [--model lenskit/default_model] [--out docs/figures]

Everything is computed from the configs (no weights are read), with the conventions stated in
`lenskit.accounting`: non-embedding parameters exclude the token and position embeddings; FLOPs
count matmuls at 2 per weight per token, plus the attention core (Q K^T and pattern V, the full
n_ctx x n_ctx score matrix) at each model's own context length; training is 3x the forward pass.
Writes accounting.csv and the figures accounting_params.{png,svg} and accounting_flops.{png,svg}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lenskit  # noqa: E402
from lenses import plots  # noqa: E402
from lenskit import accounting  # noqa: E402
from lenskit.config import PRESETS, ModelConfig  # noqa: E402


def _fmt(v: float) -> str:
    """Counts with thousands separators, ratios with four significant digits."""
    return f"{int(v):,}" if float(v).is_integer() else f"{v:.4g}"


def composition(models: dict[str, ModelConfig]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per model: parameters by kind (embeddings, attention, MLP, norms) and forward FLOPs by component."""
    params, flops = [], []
    for name, cfg in models.items():
        table = accounting.param_table(cfg)
        by = table.groupby("component")["params"].sum()
        params.append({"model": name, "embeddings": by["embed"] + by["pos_embed"] + by["unembed"],
                       "attention": by["attn"], "MLP": by["mlp"], "norms": by["norms"] + by["ln_final"]})
        f = accounting.flops_per_token(cfg)["forward"]
        flops.append({"model": f"{name} (n_ctx={cfg.n_ctx})", "attention projections": f["attn_proj"],
                      "attention core": f["attn_core"], "MLP": f["mlp"], "unembedding": f["unembed"]})
    return pd.DataFrame(params), pd.DataFrame(flops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL, help="a model folder to add to the GPT-2 presets")
    ap.add_argument("--out", default="docs/figures")
    ap.add_argument("--formats", default="png,svg")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    embedded = ModelConfig.from_json(Path(args.model) / "config.json", name="embedded (lenskit-stdlib)")
    models = {**{name: cfg for name, cfg in PRESETS.items()}, embedded.name: embedded}
    table = accounting.compare(models)  # each at its own n_ctx
    table.to_csv(out / "accounting.csv", index=False)

    pd.set_option("display.width", 160)
    shown = table.set_index("model")[[
        "n_layers", "d_model", "n_ctx", "params", "non_embedding", "per_block", "per_block_over_d2", "mlp_share_of_block",
        "dense_flops_over_params", "attn_core_over_2n_nonembed", "attn_core_over_2n_total", "training_flops_per_token",
    ]]
    print(shown.T.astype(object).map(_fmt).to_string())
    gpt2 = table.set_index("model").loc["gpt2"]
    print(f"\ngpt2: {gpt2.non_embedding / 1e6:.1f}M non-embedding parameters; a block is {gpt2.per_block_over_d2:.3f} d^2 "
          f"(12 d^2 + 13 d); the MLP holds {gpt2.mlp_share_of_block:.1%} of it; forward FLOPs per token are "
          f"{gpt2.dense_flops_over_params:.2f} x params without the attention core; at n_ctx=1024 the core adds "
          f"{gpt2.attn_core_over_2n_nonembed:.1%} of 2N (N non-embedding) or {gpt2.attn_core_over_2n_total:.1%} "
          f"of 2N (N all); 6ND for 1e9 tokens: {accounting.six_nd('gpt2', 1e9):.3g} FLOPs")

    params, flops = composition(models)
    params_fig = plots.share_bars(params, ["embeddings", "attention", "MLP", "norms"], xlabel="share of parameters",
                                  title="Where the parameters are")
    flops_fig = plots.share_bars(flops, ["attention projections", "attention core", "MLP", "unembedding"],
                                 xlabel="share of forward FLOPs per token", title="Where the forward FLOPs go")
    plots.save_figures({"accounting_params": params_fig, "accounting_flops": flops_fig}, out, args.formats)
    print(f"\nwrote {out}/accounting.csv and figures ({args.formats})")


if __name__ == "__main__":
    main()

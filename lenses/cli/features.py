"""`lenskit features`: an SAE feature read through lenses at every stream after the one it writes to.

    lenskit features --sae stdlib-gpt2-sae-L3 --feature 12 --lens logit --lens runs/tuned_lens --out f12.png

By default the feature's decoder direction is read (`--mode direction`: each lens as a linear map, see
lenses/features.py); `--mode stream --prompt TEXT` adds the feature's write at its hook on the prompt and reads how
the whole run's streams change. Prints the top promoted and suppressed tokens per lens and stream; --csv writes
every row, --out the heatmap (.html/.png/.svg/.pdf).
"""

from __future__ import annotations

import argparse

import lenskit
from lenses.spec import SPEC_HELP


def add_parser(subparsers, name: str) -> None:
    p = subparsers.add_parser(name, help="read an SAE feature's direction through lenses at every later stream",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=lenskit.DEFAULT_MODEL, help="model folder, embedded or hub name (default: stdlib-gpt2)")
    p.add_argument("--sae", required=True, metavar="PATH", help="an SAE folder or file, hub path, or stdlib-gpt2-sae-L3")
    p.add_argument("--hook", default=None, help="the SAE's hook, where its files do not name it")
    p.add_argument("--feature", type=int, required=True, metavar="I", help="the latent's index")
    p.add_argument("--lens", action="append", metavar="SPEC", help=f"repeatable (default logit): {SPEC_HELP}")
    p.add_argument("--mode", choices=("direction", "stream"), default="direction")
    p.add_argument("--prompt", default=None, help="the text --mode stream runs on")
    p.add_argument("--alpha", type=float, default=1.0, help="--mode stream: how much of W_dec[I] is added (default 1)")
    p.add_argument("--top-k", type=int, default=5, metavar="K", help="tokens per stream and kind (default 5)")
    p.add_argument("--kind", choices=("promoted", "suppressed"), default="promoted", help="what the figure shows")
    p.add_argument("--out", default=None, metavar="FILE", help="heatmap: .html, .png, .svg or .pdf")
    p.add_argument("--csv", default=None, metavar="FILE", help="every row as CSV")
    from .devices import add_device_options

    add_device_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lenses.cli.figure_options import check_figure_output
    from lenses.features import feature_lens
    from lenses.spec import load_lenses
    from lenskit.io.files import open_output
    from lenskit.saes import SAE
    from lenskit.saes.features import Feature
    from lenskit.saes.splice import check_fits

    check_figure_output(args.out)
    if args.mode == "stream" and not args.prompt:
        raise ValueError("--mode stream runs the model on a prompt: pass --prompt TEXT")
    if args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    from .devices import model_options

    model = lenskit.HookedTransformer.from_pretrained(args.model, **model_options(args))
    sae = SAE.load(args.sae, hook=args.hook)
    check_fits(model, sae)  # an SAE made for another model is refused by name, before any work
    lenses = load_lenses(list(dict.fromkeys(args.lens or ["logit"])), model)
    tokens = model.to_tokens(args.prompt) if args.prompt else None
    frame = feature_lens(model, Feature(sae, args.feature), lenses, mode=args.mode, tokens=tokens, alpha=args.alpha,
                         top_k=args.top_k)
    if args.csv:
        with open_output(args.csv, "the --csv table", pipe_ok=True) as f:
            frame.to_csv(f, index=False, lineterminator="\r\n")
    if args.out:
        from lenses import plots

        plots.save_figure(plots.feature_lens_heatmap(frame, args.kind), args.out)
    print(f"feature {args.feature} of {args.sae} ({sae.hook_name_out}), {args.mode} reading; top {args.top_k} per stream")
    for kind in ("promoted", "suppressed"):
        part = frame[frame["kind"] == kind]
        table = (part.groupby(["lens", "layer"], sort=False)["token"].apply(lambda t: " ".join(repr(x) for x in t))
                 .reset_index().rename(columns={"token": kind}))
        print(table.to_string(index=False))
    if args.csv:
        print(f"wrote {args.csv} ({len(frame)} rows)")
    if args.out:
        print(f"wrote {args.out}")
    return 0

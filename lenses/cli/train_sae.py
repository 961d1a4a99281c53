"""`lenskit train-sae`: train a TopK sparse autoencoder on one hook of a `lenskit cache` export.

    lenskit cache --data corpus/ --hooks blocks.3.hook_resid_pre --out acts/
    lenskit train-sae --activations acts/ --hook blocks.3.hook_resid_pre --out sae/ --k 32 --latents 1536

The folder gets SAELens's layout (cfg.json, sae_weights.safetensors; `lenskit.saes.SAE.load` and SAELens read
it), training.json and a README.md card (tokens, MSE, FVU, L0, dead fraction, CE increase when spliced). Rerun
the same command after a kill or Ctrl-C to resume from the checkpoint in --out.
"""

from __future__ import annotations

import argparse

import lenskit


def add_parser(subparsers, name: str) -> None:
    p = subparsers.add_parser(name, help="train a TopK SAE on a `lenskit cache` export (resumes from --out)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=lenskit.DEFAULT_MODEL, help="the export's model, for the CE increase when spliced "
                   "(default: stdlib-gpt2; 'none' skips that metric)")
    p.add_argument("--activations", required=True, metavar="EXPORT_FOLDER", help="a `lenskit cache` output folder")
    p.add_argument("--hook", required=True, metavar="NAME", help="the exported hook to train on, e.g. blocks.3.hook_resid_pre")
    p.add_argument("--out", required=True, metavar="FOLDER", help="where the SAE, its checkpoint and card go")
    p.add_argument("--k", type=int, default=32, help="active latents per token (default 32)")
    p.add_argument("--latents", type=int, default=None, metavar="N", help="dictionary size (default 8 x d_in)")
    p.add_argument("--tokens", type=int, default=0, metavar="N", help="training tokens (default 0: one pass)")
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--batch-windows", type=int, default=16, metavar="W", help="export windows per step (default 16)")
    p.add_argument("--eval-windows", type=int, default=32, metavar="W", help="last windows held out for the card (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    from .devices import add_device_options

    add_device_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lenskit.io.activations import ActivationDataset

    from ..sae_training import SAERecipe, train_sae
    from ..training.lock import check_writable

    check_writable(args.out)
    rows = ActivationDataset(args.activations, args.hook)
    recipe = SAERecipe(latents=args.latents or 8 * rows.shape[-1], k=args.k, tokens=args.tokens, lr=args.lr,
                       batch_windows=args.batch_windows, eval_windows=args.eval_windows, seed=args.seed)
    from .devices import model_options

    options = model_options(args)
    model = None if args.model == "none" else lenskit.HookedTransformer.from_pretrained(args.model, **options)
    if model is not None:
        fp = rows.manifest.get("model_fingerprint")
        from lenses.tuned import model_fingerprint

        if fp is not None and fp != model_fingerprint(model):
            raise ValueError(f"{args.activations} was exported from another model ({fp}); pass its --model, or --model none")
    sae = train_sae(args.activations, rows.hook, args.out, recipe, model, progress=not args.quiet, device=options["device"])
    print(f"wrote {args.out}: {sae.extra_repr()}")
    return 0

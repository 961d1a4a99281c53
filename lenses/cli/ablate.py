"""`lenskit ablate PROMPT (--block L | --attn L | --mlp L | --head L.H | --expert L.E)... [--mode zero|mean|resample]
[--expert-mode zero|reroute]`: what the model predicts at each position with and without the ablated parts, and
what that costs.

Mean and resample ablations need reference text. By default it is `DEFAULT_REFERENCE`: modules of the
running Python's standard library that the embedded model never trained on (they fall in its held-out
split, `lenskit.io.data.is_heldout`), cut into windows. `--reference`
takes your own text files, folders or JSONL instead, which is the better choice for a model trained on
something other than Python.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

import lenskit
from lenses.cli.devices import add_device_options, model_options
from lenses.cli.figure_options import add_figure_options, check_figure_output, figure_kwargs
from lenskit.intervene.experts import EXPERT_MODES, Expert, expert_ablation_hooks
from lenskit.intervene.interventions import MODES, Attn, Block, Head, Mlp, ablation_hooks
from lenskit.io.data import HELDOUT_SAMPLE, reference_windows

DEFAULT_REFERENCE = HELDOUT_SAMPLE  # held-out stdlib modules of the embedded model's split
MEAN_WINDOW = 128  # tokens per window for mean ablation (resample windows match the prompt's length)


def _layer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer number, got {text!r}") from None


def _head(text: str) -> Head:
    layer, dot, head = text.partition(".")
    try:
        if not dot:
            raise ValueError
        return Head(int(layer), int(head))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER.HEAD such as 3.1, got {text!r}") from None


def _expert(text: str) -> Expert:
    layer, dot, expert = text.partition(".")
    try:
        if not dot:
            raise ValueError
        return Expert(int(layer), int(expert))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER.EXPERT such as 1.3, got {text!r}") from None


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    p = subparsers.add_parser(
        name, help="ablate blocks, sublayers or heads and compare predictions with the clean run",
        description="Run PROMPT clean and with the named parts ablated; print, per position, both runs' top "
                    "token, the loss on the next token and KL(clean || ablated) in nats.",
        epilog="Mean and resample ablations read reference text: by default held-out standard-library "
               f"modules ({', '.join(DEFAULT_REFERENCE)}), which the embedded model never saw in training.",
    )
    p.add_argument("prompt", help="the text to run")
    p.add_argument("--model", default=None, help="model folder, embedded model (stdlib-gpt2, stdlib-llama) or hub name (default: stdlib-gpt2)")
    p.add_argument("--block", dest="targets", action="append", type=lambda s: Block(_layer(s)), metavar="L",
                   help="skip block L (zero mode: the stream passes through unchanged); repeatable")
    p.add_argument("--attn", dest="targets", action="append", type=lambda s: Attn(_layer(s)), metavar="L",
                   help="ablate the attention write of block L; repeatable")
    p.add_argument("--mlp", dest="targets", action="append", type=lambda s: Mlp(_layer(s)), metavar="L",
                   help="ablate the MLP write of block L; repeatable")
    p.add_argument("--head", dest="targets", action="append", type=_head, metavar="L.H",
                   help="ablate head H of block L (through its z); repeatable")
    p.add_argument("--expert", dest="targets", action="append", type=_expert, metavar="L.E",
                   help="ablate expert E of block L's mixture of experts (see --expert-mode); repeatable")
    p.add_argument("--mode", choices=list(MODES), default="zero",
                   help="zero; mean over the reference tokens; or resample from a reference window (default: zero)")
    p.add_argument("--expert-mode", choices=list(EXPERT_MODES), default="zero",
                   help="for --expert: zero its contribution, other weights unchanged; or reroute: remove it from "
                        "routing, so tokens take their next-best expert (default: zero)")
    p.add_argument("--reference", nargs="+", default=None, metavar="PATH",
                   help="text files, folders or .jsonl for mean/resample (default: held-out stdlib modules)")
    p.add_argument("--seed", type=int, default=0, help="seed for the reference windows and resampling (default 0)")
    p.add_argument("--color", choices=["prob", "kl"], default="prob",
                   help="figure colour: change in the next token's probability, or KL(clean || ablated)")
    p.add_argument("--csv", default=None, help="write one row per position that has a next token")
    p.add_argument("--out", default=None, help="write the layer-by-position difference heatmap (.html with plotly.js "
                                               "inlined, about 5 MB; .png, .svg or .pdf)")
    add_device_options(p)
    add_figure_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lenses.compare import compare_runs, output_summary

    if not args.targets:
        raise ValueError("nothing to ablate: give at least one of --block L, --attn L, --mlp L, --head L.H, --expert L.E")
    from lenskit.io.files import check_output_file, open_output

    options = model_options(args)
    if args.csv:  # outputs before any work, not after it
        check_output_file(args.csv, "the --csv table", pipe_ok=True)
    check_figure_output(args.out)
    model = lenskit.HookedTransformer.from_pretrained(args.model or lenskit.DEFAULT_MODEL, **options)
    if model.tokenizer is None:
        raise ValueError(f"the model at {args.model} has no tokenizer files; lenskit ablate needs one to read PROMPT")
    tokens = model.to_tokens(args.prompt)
    experts = [t for t in args.targets if isinstance(t, Expert)]
    parts = [t for t in args.targets if not isinstance(t, Expert)]
    if args.mode != "zero" and not parts:  # an expert has no mean or resample ablation: say so, never run zero
        raise ValueError(f"--mode {args.mode} applies to --block, --attn, --mlp and --head; an --expert is ablated "
                         "by --expert-mode zero or reroute: drop --mode, or name a part it applies to")
    reference = None
    if args.mode != "zero" and parts:
        length = tokens.shape[1] if args.mode == "resample" else min(MEAN_WINDOW, model.cfg.n_ctx)
        reference = reference_windows(model.tokenizer, args.reference, length, args.seed)
    try:
        hooks = ablation_hooks(model, parts, args.mode, reference=reference, seed=args.seed) if parts else []
        hooks += expert_ablation_hooks(model, experts, args.expert_mode) if experts else []
    except IndexError as e:  # an out-of-range layer or head: a user error, reported like the others
        raise ValueError(str(e)) from None
    frame = compare_runs(model, tokens, hooks)
    summary = output_summary(frame)

    names = ", ".join(_describe(t) for t in args.targets)
    ref = "" if reference is None else f" over {len(reference)} reference windows of {reference.shape[1]} tokens"
    modes = ([f"{args.mode}{ref}"] if parts else []) + ([f"experts {args.expert_mode}"] if experts else [])
    print(f"ablated {names} ({', '.join(modes)}) in {model.cfg.name}, {tokens.shape[1]} tokens")
    if summary.empty:
        print("the prompt has one token, so no position has a next token to score; give a longer prompt")
    else:
        _print_table(summary)
        clean, ablated = summary["clean_loss"].mean(), summary["ablated_loss"].mean()
        print(f"mean loss {clean:.3f} -> {ablated:.3f} nats/token ({ablated - clean:+.3f}); "
              f"mean KL(clean || ablated) {summary['kl'].mean():.3f} nats")
    if args.csv:
        with open_output(args.csv, "the --csv table", pipe_ok=True) as f:
            summary.to_csv(f, index=False)
        print(f"wrote {args.csv}")
    if args.out:
        from lenses import plots

        value = "delta_target_prob" if args.color == "prob" else "kl"
        fig = plots.difference_heatmap(frame, value, title=args.title or f"{names} ablated ({args.mode})",
                                       **figure_kwargs(args))
        plots.save_figure(fig, args.out)
        print(f"wrote {args.out}")
    return 0


def _describe(target) -> str:
    if isinstance(target, Head):
        return f"head {target.layer}.{target.heads[0]}"
    if isinstance(target, Expert):
        return f"expert {target.layer}.{target.experts[0]}"
    return f"{type(target).__name__.lower()} {target.layer}"


def _print_table(summary: pd.DataFrame) -> None:
    from lenskit.io.text import show_token

    show = lambda t: show_token(str(t), 14)  # noqa: E731 - visible whitespace keeps the table on one line
    table = pd.DataFrame({
        "pos": summary["position"], "input": summary["input_token"].map(show), "next": summary["target_token"].map(show),
        "clean top": summary["clean_top_token"].map(show), "ablated top": summary["ablated_top_token"].map(show),
        "clean loss": summary["clean_loss"].map("{:.3f}".format), "ablated loss": summary["ablated_loss"].map("{:.3f}".format),
        "Δ loss": summary["delta_loss"].map("{:+.3f}".format), "KL": summary["kl"].map("{:.3f}".format),
    })
    sys.stdout.write(table.to_string(index=False) + "\n")

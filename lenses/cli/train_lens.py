"""`lenskit train-lens`: train a tuned lens on text files, folders or JSONL; resumes from --out.

Under torchrun the same command trains with DistributedDataParallel (NCCL on GPUs, gloo on CPU):

    torchrun --nproc-per-node 2 -m lenses.cli train-lens --data corpus/ --out my_lens

Batch size: with neither --steps nor --tokens-per-step, 250 steps of min(2**18, data tokens / 250)
tokens, but never fewer than 2**13 tokens a step: small data gets fewer steps, not tiny batches.

Resuming and extending: rerun the same command to resume an interrupted run (Ctrl-C, SIGTERM, SIGHUP and
SIGUSR1 save a checkpoint first; others come every --ckpt-every steps and at most --ckpt-minutes apart).
Rerun it with a different --steps (not below the steps done) to extend or shorten a run, finished or not:
the learning-rate schedule is re-derived for the new total, so the result is not the same as a
fresh run of that many steps. Any other setting that differs is refused, naming the field.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lenskit
from lenses.training.recipe import DEFAULT_STEPS, MIN_TOKENS_PER_STEP, Recipe

DEFAULT = Recipe()  # every option's default is the recipe's own


def add_parser(subparsers, name: str) -> None:
    p = subparsers.add_parser(name, help="train a tuned lens (resumes from --out)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stdlib-gpt2", help="model folder, embedded model (stdlib-gpt2, stdlib-llama) or hub name (default: stdlib-gpt2)")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH", help="text files, folders (.py/.txt/.md/... inside) or .jsonl")
    p.add_argument("--out", required=True, metavar="FOLDER", help="where checkpoints and the finished lens go")
    p.add_argument("--steps", type=int, default=DEFAULT.steps,
                   help=f"optimiser steps (default {DEFAULT_STEPS}, as tuned-lens, or fewer on small data so that each step "
                        f"holds at least {MIN_TOKENS_PER_STEP:,} tokens; a rerun with more extends the run)")
    p.add_argument("--tokens-per-step", type=int, default=DEFAULT.tokens_per_step,
                   help="tokens per step, a multiple of --ctx (default: min(2**18, data tokens / steps))")
    p.add_argument("--seed", type=int, default=DEFAULT.seed, help=f"decides the order of the data windows (default {DEFAULT.seed})")
    p.add_argument("--ctx", type=int, default=DEFAULT.ctx, help="window length in tokens (default: the model's n_ctx)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default=DEFAULT.optimizer,
                   help=f"sgd: Nesterov momentum; adam: AMSGrad (default {DEFAULT.optimizer})")
    p.add_argument("--lr", type=float, default=DEFAULT.lr, help="learning rate (default: 1 - momentum for sgd, 1e-3 for adam)")
    p.add_argument("--weight-decay", type=float, default=DEFAULT.weight_decay,
                   help=f"decay of the translators toward the identity (default {DEFAULT.weight_decay:g})")
    p.add_argument("--resid-mid", action="store_true", help="also train translators for each block's resid_mid")
    p.add_argument("--bias-only", action="store_true",
                   help="translators h + b_l, a learned bias alone (the tuned-lens paper's bias-only lens; no A_l)")
    p.add_argument("--micro-batch-tokens", type=int, default=DEFAULT.micro_batch_tokens,
                   help=f"tokens per forward pass (memory, not maths; default {DEFAULT.micro_batch_tokens})")
    p.add_argument("--ckpt-every", type=int, default=DEFAULT.ckpt_every,
                   help=f"steps between checkpoints (default {DEFAULT.ckpt_every})")
    p.add_argument("--ckpt-minutes", type=float, default=DEFAULT.ckpt_minutes,
                   help=f"and at most this many minutes between checkpoints (default {DEFAULT.ckpt_minutes:g})")
    p.add_argument("--text-field", default="text", help="the JSONL field that holds the text")
    p.add_argument("--autocast", action="store_true",
                   help="bf16 mixed precision (torch.autocast): the model's forward, the translators and the readout's "
                        "matmuls, on a GPU only (refused on the CPU); recorded in the recipe, so a run is resumed with "
                        "the same setting")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from .devices import add_device_options
    add_device_options(p)
    p.set_defaults(run=run)


def finished_steps(out: Path) -> int | None:
    """The steps done of a finished lens already in `out` (with no checkpoint beside it), else None."""
    from ..io import CONFIG_FILE, read_config
    from ..training import CHECKPOINT_FILE

    if not (out / CONFIG_FILE).is_file() or (out / CHECKPOINT_FILE).exists():
        return None
    try:
        done = read_config(out).get("steps_done")
    except (OSError, ValueError):
        return None
    return done if isinstance(done, int) else None


def run(args: argparse.Namespace) -> int:
    from lenskit.io.data import load_token_stream

    from ..stopping import exit_code, stopped_by
    from ..training import check_autocast, init_distributed, train
    from ..training.interrupt import Interrupted
    from ..training.lock import check_writable
    from ..tuned import TunedLens

    # The recipe checks its fields on construction: bad flags fail before the model or the data load.
    recipe = Recipe(steps=args.steps, tokens_per_step=args.tokens_per_step, seed=args.seed, ctx=args.ctx,
                    optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, ckpt_every=args.ckpt_every,
                    ckpt_minutes=args.ckpt_minutes,
                    micro_batch_tokens=args.micro_batch_tokens, autocast=args.autocast)
    check_writable(args.out)  # before any work, not at the first checkpoint
    rank, world, device = init_distributed()
    from .devices import model_options

    options = model_options(args, device, announce=rank == 0)
    check_autocast(recipe, options["device"])
    model = lenskit.HookedTransformer.from_pretrained(args.model, **options)
    if model.tokenizer is None:
        raise ValueError(f"the model at {args.model} has no tokenizer files; train-lens needs one to read text")
    stream = load_token_stream(args.data, model.tokenizer, text_field=args.text_field)
    if rank == 0:
        print(f"data: {stream.provenance['n_files']} files, {len(stream):,} tokens; model: {model.cfg.name} "
              f"({model.cfg.n_layers} layers); processes: {world}")
    before = finished_steps(Path(args.out))
    try:
        lens = train(TunedLens(model, resid_mid=args.resid_mid, bias_only=args.bias_only), stream, recipe, out=args.out,
                     progress=not args.quiet)
    except FloatingPointError as e:  # a diverged run: say so plainly, the checkpoint is kept
        print(f"lenskit train-lens: error: {e}", file=sys.stderr)
        return 3
    except Interrupted as e:  # Ctrl-C, SIGTERM, SIGHUP, SIGUSR1: the steps done are checkpointed
        if rank == 0:
            print(f"lenskit train-lens: {e}", file=sys.stderr)
        return exit_code()
    except KeyboardInterrupt:  # outside the steps (saving the finished lens): the last checkpoint stands
        if rank == 0:
            print(f"lenskit train-lens: {stopped_by()}interrupted; run the same command to resume from the last "
                  "checkpoint", file=sys.stderr)
        return exit_code()
    if before is not None and lens.info.get("steps_done") == before:
        return 0  # the finished lens was already there; train() said so
    if rank == 0:
        last = lens.info.get("loss_history", [[]])[-1]
        print(f"wrote {args.out}: {lens.info.get('steps_done')} steps, {lens.info.get('tokens_seen', 0):,} tokens; "
              f"final KL per stream (nats): {' '.join(f'{x:.4f}' for x in last)}")
    if world > 1:
        from ..training import finish_distributed

        finish_distributed()
    return 0

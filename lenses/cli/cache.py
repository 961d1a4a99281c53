"""`lenskit cache`: export activations of text to sharded safetensors with a JSON manifest (for SAE training).

    lenskit cache --data corpus/ --hooks resid_post.6,resid_mid.12 --out acts/
    torchrun --nproc-per-node 4 -m lenses.cli cache --model M --data corpus/ --hooks resid_post.6 --out acts/

Hooks are full names (blocks.6.hook_resid_post) or short ones (resid_post.6, mlp_out.-1, z.3). The data is cut
into windows of --ctx tokens; shard k holds windows k * W onwards. Rerun the same command after a kill, Ctrl-C,
SIGTERM, SIGHUP or SIGUSR1 to resume: the shards written are kept and skipped once verified (checksum, name,
windows), and those that fail are written again. Integer hooks (expert indices) are stored as int64. Read
the rows back with `lenskit.io.activations.ActivationDataset(OUT, hook)`; the format is in docs/activation_export.md.
"""

from __future__ import annotations

import argparse
import sys

import lenskit
from lenses.cli.devices import add_device_options, model_options


def add_parser(subparsers, name: str) -> None:
    p = subparsers.add_parser(name, help="export activations to sharded safetensors (resumes from --out)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stdlib-gpt2", help="model folder, embedded model (stdlib-gpt2, stdlib-llama) or hub name (default: stdlib-gpt2)")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH", help="text files, folders or .jsonl")
    p.add_argument("--hooks", required=True, metavar="NAMES", help="comma-separated hooks, e.g. resid_post.6,resid_mid.12")
    p.add_argument("--out", required=True, metavar="FOLDER", help="where the shards and manifest.json go")
    p.add_argument("--tokens", type=int, default=0, metavar="N", help="export the first N tokens of --data (default 0 = all)")
    p.add_argument("--ctx", type=int, default=None, help="window length (default: the model's n_ctx)")
    p.add_argument("--store-dtype", default=None, metavar="DTYPE",
                   help="the dtype the activations are stored in: float32, bfloat16, float16 or their short names "
                        "(default: the model's, see --dtype)")
    p.add_argument("--windows-per-shard", type=int, default=None, metavar="W",
                   help="windows in each shard (default: shards of about 256 MiB)")
    p.add_argument("--batch", type=int, default=8, help="windows per forward pass (memory, not results; default 8)")
    p.add_argument("--text-field", default="text", help="the JSONL field that holds the text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lenskit.io.activations import resolve_hooks
    from lenskit.io.data import load_token_stream

    from ..activation_export import export_activations
    from ..evaluation import heldout_windows
    from ..training import init_distributed
    from ..training.lock import check_writable

    check_writable(args.out)  # before any work
    if args.windows_per_shard is not None and args.windows_per_shard < 1:
        raise ValueError(f"--windows-per-shard must be >= 1, got {args.windows_per_shard}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    from lenskit.devices import parse_dtype

    store = parse_dtype(args.store_dtype, name="--store-dtype") if args.store_dtype is not None else None
    rank, world, device = init_distributed()
    model = lenskit.HookedTransformer.from_pretrained(args.model, **model_options(args, device, announce=rank == 0))
    if model.tokenizer is None:
        raise ValueError(f"the model at {args.model} has no tokenizer files; lenskit cache needs one to read text")
    hooks = resolve_hooks(model, args.hooks)  # an unknown name is refused before the data is read
    stream = load_token_stream(args.data, model.tokenizer, text_field=args.text_field)
    windows = heldout_windows(stream, args.tokens or None, args.ctx or model.cfg.n_ctx, model.cfg.n_ctx)
    if rank == 0:
        print(f"data: {stream.provenance['n_files']} files, {len(stream):,} tokens, {len(windows):,} windows of "
              f"{windows.shape[1]}; hooks: {', '.join(hooks)}; processes: {world}")
    try:
        manifest = export_activations(model, windows, hooks, args.out, provenance=stream.provenance,
                                      dtype=store,
                                      windows_per_shard=args.windows_per_shard, batch=args.batch, progress=not args.quiet)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP, SIGUSR1: the shards written are whole and listed
        from ..stopping import exit_code, stopped_by

        if rank == 0:
            print(f"lenskit cache: {stopped_by()}interrupted; the shards written are kept in {args.out}: run the same "
                  "command to resume", file=sys.stderr)
        return exit_code()
    if rank == 0:
        print(f"wrote {args.out}: {manifest['n_shards']} shards, {manifest['n_windows'] * manifest['ctx']:,} tokens "
              f"of {len(hooks)} hooks in {manifest['dtype']}")
    if world > 1:
        from ..training import finish_distributed

        finish_distributed()
    return 0

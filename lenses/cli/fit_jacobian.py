"""`lenskit fit-jacobian`: fit a Jacobian lens (JacobianLens.fit) on text or tokens; resumes from --out.

The prompts: --data is text (files, folders of text, .jsonl), read and tokenized as train-lens reads it, or
token files (.safetensors holding one integer tensor named `tokens`: [n_tokens], a stream, or [n, T], prompts
as they are). A stream is cut into non-overlapping windows of --tokens tokens, and --prompts of them are drawn
in an order that depends only on --seed; [n, T] prompts are taken in order, the first --prompts of them.

Resuming: the fit checkpoints in --out every 16 prompts and when interrupted (Ctrl-C), whole prompts only. The
same command resumes from the checkpoint; any setting or prompt that differs is refused, naming it. A finished
lens in --out is left as it is.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TOKEN_FILE_SUFFIX = ".safetensors"
DEFAULT_PROMPTS = 100
DEFAULT_TOKENS = 128


def add_parser(subparsers, name: str) -> None:
    from lenses.jacobian import DIM_BATCH, SKIP_FIRST_POSITIONS

    p = subparsers.add_parser(name, help="fit a Jacobian lens on text or tokens (resumes from --out)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stdlib-gpt2", help="model folder, embedded model (stdlib-gpt2, stdlib-llama) or hub name (default: stdlib-gpt2)")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH",
                   help="text files, folders (.py/.txt/.md/... inside) or .jsonl; or .safetensors token files (a `tokens` tensor)")
    p.add_argument("--out", required=True, metavar="FOLDER", help="where the checkpoint and the finished lens go")
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help=f"prompts to average over (default {DEFAULT_PROMPTS})")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens per prompt cut from a stream (default {DEFAULT_TOKENS}); [n, T] token files keep their T")
    p.add_argument("--streams", nargs="+", default=None, metavar="S",
                   help="streams to fit, at block boundaries: stream numbers (3, -1) or names such as resid_post.2 (= stream 3); "
                        "default every stream 0..n_layers-1")
    p.add_argument("--dim-batch", type=int, default=None,
                   help=f"output dimensions per backward pass (speed only; default: the device's, {DIM_BATCH} on the CPU)")
    p.add_argument("--skip-first-positions", type=int, default=SKIP_FIRST_POSITIONS,
                   help=f"positions left out at the start of each prompt (default {SKIP_FIRST_POSITIONS}, the reference's)")
    p.add_argument("--seed", type=int, default=0, help="decides which windows of a stream are drawn (default 0)")
    p.add_argument("--text-field", default="text", help="the JSONL field that holds the text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from .devices import add_device_options

    add_device_options(p)
    p.set_defaults(run=run)


def stream_spec(text: str) -> int | str:
    """A --streams word: an int when it is one, else a name that lenskit.Stream.parse reads."""
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def read_token_file(path: Path):
    """The integer `tokens` tensor of a .safetensors file, [n_tokens] or [n, T]; refused in one line otherwise."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            if keys != ["tokens"]:
                raise ValueError(f"token file {path} holds {keys[:4]}; expected one tensor named 'tokens' ([n_tokens] or [n, T])")
            tokens = f.get_tensor("tokens")
    except SafetensorError as e:
        raise ValueError(f"token file {path} is not a readable .safetensors file ({e}); write one with "
                         "safetensors.torch.save_file({'tokens': ids}, path)") from None
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.dim() not in (1, 2):
        raise ValueError(f"token file {path}: 'tokens' is {tokens.dtype} {list(tokens.shape)}; expected integer ids, "
                         "[n_tokens] or [n, T]")
    return tokens.long()


def choose_prompts(args: argparse.Namespace, model) -> tuple["torch.Tensor", dict]:
    """The prompts [n, T] the lens is fitted on, and the provenance that says how they were chosen."""
    import hashlib

    import torch

    from lenskit.io.data import load_token_stream, portable_path, window_order

    if args.prompts < 1 or args.tokens < 2:
        raise ValueError(f"--prompts must be at least 1 and --tokens at least 2, got {args.prompts} and {args.tokens}")
    files = [Path(p) for p in args.data]
    token_files = [p for p in files if p.suffix.lower() == TOKEN_FILE_SUFFIX]
    if token_files and len(token_files) != len(files):
        raise ValueError("--data mixes token files (.safetensors) and text; pass one kind or the other")
    selection = {"prompts": args.prompts, "tokens": args.tokens, "seed": args.seed}
    if not token_files:
        if model.tokenizer is None:
            raise ValueError(f"the model at {args.model} has no tokenizer files; pass token files (.safetensors) or a model with one")
        stream = load_token_stream(args.data, model.tokenizer, text_field=args.text_field)
        windows = stream.windows(args.tokens)
        pick = window_order(len(windows), args.seed)[: args.prompts].sort().values  # in stream order
        return windows[pick], {**stream.provenance, "selection": selection}
    parts, records = [], []
    for path in token_files:
        tokens = read_token_file(path)
        parts.append(tokens)
        records.append({"path": portable_path(path, path), "shape": list(tokens.shape),
                        "sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()})
    provenance = {"token_files": records, "selection": selection}
    if all(t.dim() == 2 for t in parts) and len({t.shape[1] for t in parts}) == 1:
        return torch.cat(parts)[: args.prompts], provenance
    if any(t.dim() == 2 for t in parts):
        raise ValueError("the token files mix [n, T] prompts of different T or with [n_tokens] streams; pass one form")
    stream = torch.cat(parts)
    n = len(stream) // args.tokens
    if n == 0:
        raise ValueError(f"the token files hold {len(stream)} tokens, fewer than one prompt of --tokens {args.tokens}")
    windows = stream[: n * args.tokens].view(n, args.tokens)
    return windows[window_order(n, args.seed)[: args.prompts].sort().values], provenance


def run(args: argparse.Namespace) -> int:
    import lenskit
    from lenses.io import CONFIG_FILE
    from lenses.jacobian import JacobianLens
    from lenses.training.lock import check_writable

    from .devices import model_options

    options = model_options(args)  # a bad --device or --dtype fails before any work
    check_writable(args.out)  # before any work, not at the first checkpoint
    finished = (Path(args.out) / CONFIG_FILE).exists()
    model = lenskit.HookedTransformer.from_pretrained(args.model, **options)
    prompts, provenance = choose_prompts(args, model)
    streams = None if args.streams is None else [stream_spec(s) for s in args.streams]
    print(f"fitting a Jacobian lens: {len(prompts)} prompts of {prompts.shape[1]} tokens; model: {model.cfg.name} "
          f"({model.cfg.n_layers} layers)", flush=True)
    try:
        lens = JacobianLens.fit(model, prompts, skip_first_positions=args.skip_first_positions, streams=streams,
                                dim_batch=args.dim_batch, progress=not args.quiet, out=args.out, provenance=provenance)
    except KeyboardInterrupt:
        print(f"lenskit fit-jacobian: interrupted; the prompts done are checkpointed in {args.out}: run the same command "
              "to resume", file=sys.stderr)
        return 130
    est = lens.info.get("estimator", {})
    print(f"{'the lens is in' if finished else 'wrote'} {args.out}: J for streams {lens.streams}, {est.get('n_prompts')} prompts, "
          f"{est.get('n_tokens')} tokens; use it with --lens jacobian:{args.out} or JacobianLens.load({str(args.out)!r}, model)")
    return 0

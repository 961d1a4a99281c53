"""Tokens per second of greedy generation with and without the KV cache, on the embedded model.

    python benchmarks/bench_generate.py [--new 64] [--prompts 8 128] [--batch 1 8] [--rounds 5] [--threads 2]

Each case generates `--new` tokens (stop_at_eos=False, so every run makes all of them) after a prompt of
`prompt` tokens of held-out standard-library text, for `batch` rows:

- cached: `model.generate(..., use_past_kv_cache=True)` (lenskit.kv_cache): the prompt once, then each token alone;
- uncached: `use_past_kv_cache=False`: the whole sequence again for every new token.

Both must give the same tokens, which is checked before timing. The cases are interleaved round by round, the
order rotated, and the median of `--rounds` samples kept (tokens/s = batch x new / seconds). Writes
benchmarks/generate_speed.csv.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lenskit  # noqa: E402
from lenskit.io.data import load_token_stream  # noqa: E402

FILES = ("copy.py", "base64.py", "gzip.py")  # held-out modules of the embedded model (see bench_eval.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "generate_speed.csv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = lenskit.HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL).eval()
    root = Path(sysconfig.get_paths()["stdlib"])
    stream = load_token_stream([str(root / f) for f in FILES if (root / f).is_file()], model.tokenizer).tokens
    cases = []
    for n_prompt in args.prompts:
        if n_prompt + args.new > model.cfg.n_ctx:
            sys.exit(f"prompt {n_prompt} + new {args.new} passes n_ctx={model.cfg.n_ctx}: past it no step is cached")
        for batch in args.batch:
            tokens = torch.stack([stream[i * n_prompt: (i + 1) * n_prompt] for i in range(batch)])  # [batch, prompt]
            runs = {c: model.generate(tokens, args.new, stop_at_eos=False, use_past_kv_cache=c) for c in (True, False)}
            assert torch.equal(runs[True], runs[False]), f"prompt {n_prompt}, batch {batch}: cached tokens differ"
            cases += [(n_prompt, batch, cached, tokens) for cached in (True, False)]

    samples: dict[tuple, list[float]] = {c[:3]: [] for c in cases}
    for r in range(args.rounds):
        for n_prompt, batch, cached, tokens in cases[r % len(cases):] + cases[: r % len(cases)]:
            start = time.perf_counter()
            model.generate(tokens, args.new, stop_at_eos=False, use_past_kv_cache=cached)
            samples[n_prompt, batch, cached].append(batch * args.new / (time.perf_counter() - start))

    rows = []
    print(f"{'prompt':>6} {'batch':>5} {'cached tok/s':>13} {'uncached tok/s':>15} {'ratio':>6}")
    for n_prompt in args.prompts:
        for batch in args.batch:
            fast, slow = (statistics.median(samples[n_prompt, batch, c]) for c in (True, False))
            print(f"{n_prompt:>6} {batch:>5} {fast:>13.0f} {slow:>15.0f} {fast / slow:>6.2f}")
            rows.append(dict(prompt=n_prompt, batch=batch, new=args.new, cached_tok_s=round(fast, 1),
                             uncached_tok_s=round(slow, 1), ratio=round(fast / slow, 2), threads=args.threads))
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()

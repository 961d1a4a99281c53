"""Rows per second of the patchscope (lenses.Patchscope) against the logit lens, on the embedded model.

    python benchmarks/bench_patchscope.py [--rows 1 16 64 256 1024] [--stream 3] [--rounds 7] [--threads 2]

Each case decodes `rows` real residual rows of held-out standard-library text at one stream into a reused
float32 buffer (`logits_into`, as evaluation calls a lens), under `torch.no_grad()`:

- logit: the logit lens (final norm and unembedding of each row);
- patchscope: `Patchscope(model)`, the default identity prompt, each row patched at its placeholder. The
  target prompt's stream before the patched block is computed once per call and only the blocks from the
  patched one on run per row;
- patchscope, full forward: the same patch as a hook on the whole model's forward for every row (the
  straightforward implementation, kept here to show what sharing the prompt's prefix saves). Its logits
  are checked against the patchscope's before timing.

A timed sample repeats a call until it has run for at least 0.2 s (rows/s = rows x calls / seconds); the
cases are interleaved round by round, the order rotated, and the median of `--rounds` samples kept.
Writes benchmarks/patchscope_speed.csv (the log is what it prints; `run_all.sh` keeps it in
benchmarks/logs/patchscope.txt).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lenskit  # noqa: E402
from lenses import LogitLens, Patchscope  # noqa: E402
from lenskit import Stream  # noqa: E402
from lenskit.io.data import load_token_stream  # noqa: E402

FILES = ("copy.py", "base64.py", "gzip.py")  # held-out modules of the embedded model (see bench_eval.py)
MIN_SAMPLE_S = 0.2


def full_forward(model: lenskit.HookedTransformer, ps: Patchscope, h: torch.Tensor, s: Stream, out: torch.Tensor) -> torch.Tensor:
    """The patchscope as one hooked forward of the whole target prompt per chunk of rows."""
    name, p = ps.target(s).hook_name(model.cfg.n_layers), ps.position
    tokens = ps.target_tokens[None]
    for start in range(0, len(h), ps.chunk_rows):
        rows = h[start: start + ps.chunk_rows]

        def patch(x: torch.Tensor, hook, rows=rows) -> torch.Tensor:
            x = x.clone()
            x[:, p] = rows
            return x

        x = model.run_with_hooks(tokens.expand(len(rows), -1), fwd_hooks=[(name, patch)], stop_at_layer=model.cfg.n_layers)
        model.readout.into(x[:, -1], out[start: start + len(rows)])
    return out


def sample(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    ap.add_argument("--stream", type=int, default=3, help="the source (and target) stream; default 3 of 0..6")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "patchscope_speed.csv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")
    n, s = model.cfg.n_layers, Stream(args.stream).resolve(model.cfg.n_layers)
    root = Path(sysconfig.get_paths()["stdlib"])
    text = load_token_stream([str(root / f) for f in FILES if (root / f).is_file()], model.tokenizer)
    windows = text.windows(model.cfg.n_ctx)
    need = max(args.rows)
    with torch.no_grad():
        _, cache = model.run_with_cache(windows[: -(-need // model.cfg.n_ctx)], names_filter=s.hook_name(n))
    pool = cache.stream(s).reshape(-1, model.cfg.d_model)[:need]
    if len(pool) < need:
        raise SystemExit(f"the held-out text gives {len(pool)} rows; ask for at most that many with --rows")

    ps, logit = Patchscope(model), LogitLens(model)
    print(f"model: stdlib-gpt2, {n} layers, d_model {model.cfg.d_model}, d_vocab {model.cfg.d_vocab}; stream {s}; "
          f"target prompt {len(ps.target_tokens)} tokens, placeholder at {ps.position}, {ps.chunk_rows} rows per forward; "
          f"torch {torch.__version__}, {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    results = []
    for rows in args.rows:
        h = pool[:rows]
        out = torch.empty(rows, model.cfg.d_vocab)
        cases = {
            "logit": lambda: logit.logits_into(h, s, out),
            "patchscope": lambda: ps.logits_into(h, s, out),
            "patchscope, full forward": lambda: full_forward(model, ps, h, s, out),
        }
        with torch.no_grad():
            want = ps.logits_into(h, s, torch.empty_like(out)).clone()
            torch.testing.assert_close(full_forward(model, ps, h, s, out), want, atol=1e-5, rtol=1e-5)
            calls = {}
            for name, fn in cases.items():  # warm-up, and how many calls make a sample
                one = sample(fn, 1)
                calls[name] = max(1, int(MIN_SAMPLE_S / max(one, 1e-6)))
            times = {name: [] for name in cases}
            names = list(cases)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    times[name].append(sample(cases[name], calls[name]) / calls[name])
        for name in cases:
            median = statistics.median(times[name])
            results.append(dict(case=name, rows=rows, stream=str(s), median_s=median, rows_per_s=rows / median))
            print(f"{name:>25}: {rows:5d} rows in {median * 1e3:9.3f} ms median -> {rows / median:10.0f} rows/s")
        ratio = statistics.median(f / p for f, p in zip(times["patchscope, full forward"], times["patchscope"]))
        print(f"{'':>25}  patchscope / full forward speed: {ratio:.2f}x; logit / patchscope: "
              f"{statistics.median(times['patchscope']) / statistics.median(times['logit']):.0f}x")
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "rows", "stream", "median_s", "rows_per_s"])
        writer.writeheader()
        writer.writerows(results)
    print(f"load {os.getloadavg()[0]:.1f} at the end; wrote {args.csv}")


if __name__ == "__main__":
    main()

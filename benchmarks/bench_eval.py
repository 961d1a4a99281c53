"""Tokens per second of `eval-lens` (evaluate: logit and tuned lens, every layer) against `train-lens`
(train: forward, lens, KL and backward) on the embedded model and held-out standard-library text.

    python benchmarks/bench_eval.py [--tokens 8192] [--steps 4] [--threads 2] [--device cuda]

Both read the same windows of n_ctx tokens. Training runs `--steps` steps of `--tokens` / `--steps`
tokens each; evaluation reads `--tokens` tokens. Each is timed `--repeats` times after one warm-up
call, the two interleaved round by round, and the median is kept. Writes benchmarks/eval_speed.csv and the
section "eval-lens against train-lens" of benchmarks/results.md; with `--device cuda`, eval_speed-cuda.csv only
(benchmarks/gpu_check.sh prints it for results.md's GPU section).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lenskit  # noqa: E402
from lenses import LogitLens, TunedLens  # noqa: E402
from lenses.evaluation import evaluate  # noqa: E402
from lenses.training import Recipe, train  # noqa: E402
from lenskit.io.data import load_token_stream  # noqa: E402

# Held-out modules of the embedded model (see lenses/cli/ablate.py), plus more text to fill the windows.
FILES = ("copy.py", "base64.py", "gzip.py", "enum.py", "typing.py", "argparse.py")
MARK = "## eval-lens against train-lens"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = lenskit.HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL, device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    root = Path(sysconfig.get_paths()["stdlib"])
    stream = load_token_stream([str(root / f) for f in FILES if (root / f).is_file()], model.tokenizer)
    ctx = model.cfg.n_ctx
    per_step = args.tokens // args.steps // ctx * ctx
    if len(stream) < args.tokens:
        raise SystemExit(f"the reference text holds {len(stream)} tokens; ask for at most that many with --tokens")

    def run_train() -> None:
        # no out= folder: nothing is checkpointed or saved, so only the training itself is timed
        train(TunedLens(model), stream, Recipe(steps=args.steps, tokens_per_step=per_step), progress=False)

    tuned = TunedLens(model)

    def run_eval() -> None:
        evaluate(model, {"logit": LogitLens(model), "tuned": tuned}, stream, tokens=args.tokens, progress=False)

    load_start = os.getloadavg()[0]
    cases = {"train-lens": (run_train, per_step * args.steps), "eval-lens": (run_eval, args.tokens // ctx * ctx)}
    for fn, _ in cases.values():
        fn()  # warm-up
    times = {name: [] for name in cases}
    for r in range(args.repeats):  # interleaved, the order alternating, so that a slow minute slows all alike
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            start = time.perf_counter()
            cases[name][0]()
            sync()
            times[name].append(time.perf_counter() - start)
    results = {}
    for name, (_, tokens) in cases.items():
        median = statistics.median(times[name])
        results[name] = dict(case=name, tokens=tokens, median_s=median, tokens_per_s=tokens / median)
        print(f"{name}: {tokens} tokens in {median:.2f} s median -> {tokens / median:.0f} tokens/s")
    ratio = results["eval-lens"]["tokens_per_s"] / results["train-lens"]["tokens_per_s"]
    per_round = statistics.median((cases["eval-lens"][1] / e) / (cases["train-lens"][1] / t)
                                  for e, t in zip(times["eval-lens"], times["train-lens"]))
    print(f"eval / train tokens per second: {ratio:.2f} (target >= 0.8); median of per-round ratios {per_round:.2f}")

    out = ROOT / "benchmarks"
    suffix = "" if args.device == "cpu" else f"-{args.device.split(':')[0]}"
    with open(out / f"eval_speed{suffix}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "tokens", "median_s", "tokens_per_s"])
        writer.writeheader()
        writer.writerows(results.values())
    if suffix:
        print(f"wrote {out / f'eval_speed{suffix}.csv'} (results.md keeps the CPU section)")
        return
    section = (f"{MARK}\n\n`python benchmarks/bench_eval.py --tokens {args.tokens} --steps {args.steps} --repeats {args.repeats} "
               f"--threads {args.threads}`: the embedded model, held-out standard-library text, windows of {ctx} tokens, "
               f"{args.repeats} interleaved rounds, medians, one-minute load average {load_start:.1f} at the start and "
               f"{os.getloadavg()[0]:.1f} at the end (every case shares the machine alike). eval-lens scores the logit and a tuned lens at every layer; train-lens "
               f"adds the backward pass and the optimizer step. Both are plain torch ops (one evaluation path for every lens)."
               + "\n\n| case | tokens | median s | tokens/s |\n|---|---|---|---|\n"
               + "".join(f"| {r['case']} | {r['tokens']} | {r['median_s']:.2f} | {r['tokens_per_s']:.0f} |\n" for r in results.values())
               + f"\neval / train: {ratio:.2f} (target >= 0.8); median of the per-round ratios: {per_round:.2f}\n")
    report = out / "results.md"
    text = report.read_text() if report.exists() else ""
    text = re.sub(rf"\n{re.escape(MARK)}\n.*?(?=\n## |\Z)", "", text, flags=re.S).rstrip("\n")
    report.write_text(text + "\n\n" + section)
    print(f"wrote {out / 'eval_speed.csv'} and the section of {report}")


if __name__ == "__main__":
    main()

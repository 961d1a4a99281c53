"""The bf16 forward on the CPU, side by side: lenskit against transformers 5, both loaded in bf16 from the same
folder of GPT-2-small-shaped random weights (bench.py's), fp32 rows of both for context.

Interleaved rounds (the order rotated each round), `torch.inference_mode()`, medians and ratios of medians.

    python benchmarks/bench_bf16.py                      # prints a markdown section for results.md
    python benchmarks/bench_bf16.py --shapes 1x256 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cases import ensure_model_folder, make_tokens, timed  # noqa: E402

from lenskit import HookedTransformer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/lenskit/bench/gpt2-random-seed0")
    p.add_argument("--shapes", default="4x256,1x1024")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    folder = ensure_model_folder(args.model_dir, 0)
    models = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        models[f"lenskit_{name}"] = HookedTransformer.from_pretrained(folder, dtype=dtype)
        models[f"transformers_{name}"] = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    attn = models["transformers_bf16"].config._attn_implementation
    load0 = os.getloadavg()[0]
    rows = {}
    for shape in args.shapes.split(","):
        batch, pos = (int(x) for x in shape.split("x"))
        tokens = make_tokens(batch, pos, models["lenskit_bf16"].cfg.d_vocab, 0)
        with torch.inference_mode():
            want = models["transformers_bf16"](tokens).logits.float()
            err = float((models["lenskit_bf16"](tokens).float() - want).abs().max())
        cases = {k: (lambda m=m, k=k: m(tokens) if k.startswith("lenskit") else m(tokens).logits) for k, m in models.items()}
        for fn in cases.values():
            timed(fn)  # warm-up
        names = list(cases)
        times = {k: [] for k in names}
        for r in range(args.rounds):
            k0 = r % len(names)
            for k in names[k0:] + names[:k0]:
                times[k].append(timed(cases[k]))
        rows[shape] = ({k: statistics.median(v) for k, v in times.items()}, err)
    print(f"`python benchmarks/bench_bf16.py --shapes {args.shapes} --rounds {args.rounds} --threads {args.threads}`: "
          f"GPT-2-small-shaped random weights, {args.rounds} interleaved rounds, {args.threads} torch thread(s), "
          f"transformers' default attention (`{attn}`), one-minute load average {load0:.1f} -> {os.getloadavg()[0]:.1f}. "
          "Median seconds per forward.\n")
    print("| shape | lenskit bf16 | transformers bf16 | bf16 ratio (target <= 1.0) | lenskit fp32 | transformers fp32 | fp32 ratio | max abs logit diff bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, (m, err) in rows.items():
        print(f"| {shape} | {m['lenskit_bf16']:.3f} | {m['transformers_bf16']:.3f} | {m['lenskit_bf16'] / m['transformers_bf16']:.2f} | "
              f"{m['lenskit_fp32']:.3f} | {m['transformers_fp32']:.3f} | {m['lenskit_fp32'] / m['transformers_fp32']:.2f} | {err:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

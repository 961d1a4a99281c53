"""Side-by-side speed and memory: lenskit against transformers and TransformerLens, in one run.

All three load the same local folder of GPT-2-small-shaped random weights (the `gpt2` preset, random
init, written once), run the same token batches in fp32 on the CPU, and are timed in interleaved rounds
so that a slow minute of a busy machine hits every contender alike. Reported: medians, ratios of
medians, achieved GFLOP/s against a matmul peak measured in the same run, the cache's peak memory
(each measurement in a fresh subprocess) and a profile of where the forward's time goes.

    python benchmarks/bench.py                 # full run: benchmarks/results.md, results.csv, timings.csv
    python benchmarks/bench.py --repeats 3     # a quick look
    python benchmarks/bench.py --device cuda   # on a GPU: results-cuda.md/.csv (+ trajectory, training step, CUDA peak memory)

TransformerLens is optional (`pip install -e .[bench]`); without it its rows are left out and the
report says why.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from bench_cases import (
    contenders,
    cuda_peak_memory,
    ensure_model_folder,
    gpu_cases,
    load_lenskit,
    load_transformer_lens,
    load_transformers,
    make_tokens,
    matmul_case,
    resid_names,
    timed,
)
from bench_memory import run_memory
from bench_report import profile_case, summarize, write_report
from tqdm import tqdm

from lenskit import ModelConfig

HERE = Path(__file__).resolve().parent


def run_timings(lk, hf, tl, shapes, repeats: int, warmup: int, seed: int, time_tl_forward: bool,
                device: str = "cpu") -> pd.DataFrame:
    """Interleaved rounds: each round runs every case once, in an order rotated round by round."""
    cases: list[tuple[str, str, Callable[[], object]]] = [("-", "matmul_peak", matmul_case(device=device))]
    for batch, pos in shapes:
        tokens = make_tokens(batch, pos, lk.cfg.d_vocab, seed).to(device)
        timed_cases = contenders(lk, hf, tl, tokens, lk.cfg.n_layers)
        if device != "cpu":
            timed_cases.update(gpu_cases(lk, tokens))
        for name, fn in timed_cases.items():
            if name != "tl_forward" or time_tl_forward:  # TL's plain forward is context, not a target
                cases.append((f"{batch}x{pos}", name, fn))
    for _, _, fn in tqdm(cases, desc="warm-up", leave=False):
        for _ in range(warmup):
            timed(fn)
    rows = []
    with tqdm(total=repeats * len(cases), desc="timing (interleaved rounds)") as bar:
        for r in range(repeats):
            k = r % len(cases)
            for shape, name, fn in cases[k:] + cases[:k]:
                rows.append(dict(round=r, shape=shape, case=name, seconds=timed(fn)))
                bar.update()
    return pd.DataFrame(rows)


# --------------------------------------------------------------------- main
def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(n) for n in s.lower().split("x")) for s in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise SystemExit(f"--shapes wants BATCHxPOS[,BATCHxPOS...], e.g. 4x256,1x1024; got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15, help="interleaved timing rounds (default 15)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls of each case first")
    p.add_argument("--memory-repeats", type=int, default=3, help="fresh processes per memory figure (0 skips)")
    p.add_argument("--shapes", default="4x256,1x1024", help="BATCHxPOS list (default 4x256,1x1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the random gpt2-shaped weights are written once (default ~/.cache/lenskit/bench)")
    p.add_argument("--out-dir", type=Path, default=HERE, help="where results.md/.csv go (default benchmarks/)")
    p.add_argument("--no-tl", action="store_true", help="leave TransformerLens out")
    p.add_argument("--tl-forward", action="store_true", help="also time TransformerLens' plain forward")
    p.add_argument("--tl-memory", action="store_true", help="also measure TransformerLens' cache memory")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda; cuda writes results-cuda.md/.csv instead")
    args = p.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device here")
    args.suffix = "" if args.device == "cpu" else f"-{args.device.split(':')[0]}"
    args.model_dir = args.model_dir or Path.home() / ".cache" / "lenskit" / "bench" / f"gpt2-random-seed{args.seed}"
    args.command = "python benchmarks/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.command = args.command.strip()
    started = time.strftime("%Y-%m-%d %H:%M")
    args.load = [os.getloadavg()[0]]  # the report says how busy the machine was
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shapes = parse_shapes(args.shapes)
    folder = ensure_model_folder(args.model_dir, args.seed)
    lk, hf = load_lenskit(folder, args.device), load_transformers(folder, args.device)
    tl, tl_note = (None, "TransformerLens left out (--no-tl).") if args.no_tl else load_transformer_lens(folder, args.device)
    tl_note = f"\n**TransformerLens rows missing:** {tl_note}\n" if tl is None else ""
    hf_attn = getattr(hf.config, "_attn_implementation", "unknown")

    batch, pos = shapes[0]
    tokens = make_tokens(batch, pos, lk.cfg.d_vocab, args.seed).to(args.device)
    names = resid_names(lk.cfg.n_layers)
    with torch.inference_mode():
        logits, cache = lk.run_with_cache(tokens, names_filter=names)
        parity = {"max|logits - transformers|": float((logits - hf(tokens).logits).abs().max())}
        if tl is not None:
            tl_logits, tl_cache = tl.run_with_cache(tokens, names_filter=lambda n: n in set(names))
            parity["max|logits - TL|"] = float((logits - tl_logits).abs().max())
            parity["max|cache - TL cache|"] = max(float((cache[n] - tl_cache[n]).abs().max()) for n in names)
    del logits, cache
    print("parity:", parity)

    t = run_timings(lk, hf, tl, shapes, args.repeats, args.warmup, args.seed, args.tl_forward, args.device)
    profiles = {}
    if args.device != "cpu":  # the CUDA allocator's peak per call, in this process; the CPU's RSS rows do not apply
        rows = []
        for b, s in shapes:
            toks = make_tokens(b, s, lk.cfg.d_vocab, args.seed).to(args.device)
            cases = {**contenders(lk, hf, tl, toks, lk.cfg.n_layers), **gpu_cases(lk, toks)}
            rows += [dict(shape=f"{b}x{s}", case=k, cuda_peak_bytes=v) for k, v in cuda_peak_memory(cases).items()]
        pd.DataFrame(rows).to_csv(args.out_dir / f"memory{args.suffix}.csv", index=False)
        args.memory_repeats = 0
    elif not args.no_profile:
        for b, s in shapes:
            cases = contenders(lk, hf, None, make_tokens(b, s, lk.cfg.d_vocab, args.seed), lk.cfg.n_layers)
            for case in ("lenskit_forward", "lenskit_cache", "transformers_forward"):
                profiles[f"{case}@{b}x{s}"] = profile_case(cases[case])
        pd.concat([p.assign(run=k) for k, p in profiles.items()]).to_csv(args.out_dir / "profile.csv", index=False)
    mem = None
    if args.memory_repeats > 0:
        mem_cases = ["lenskit_forward", "lenskit_cache"] + (["tl_forward", "tl_cache"] if tl is not None and args.tl_memory else [])
        del lk, hf, tl
        gc.collect()
        mem = run_memory(mem_cases, shapes, folder, args.seed, args.memory_repeats)
        mem.to_csv(args.out_dir / "memory.csv", index=False)
    args.load.append(os.getloadavg()[0])
    summary = summarize(t, mem, ModelConfig.from_name("gpt2"), shapes)
    write_report(args.out_dir, args, t, summary, profiles, parity, tl_note, hf_attn,
                 ModelConfig.from_name("gpt2"), shapes, started)
    print((args.out_dir / f"results{args.suffix}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

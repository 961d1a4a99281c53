"""Seconds per prompt of lenskit's `JacobianLens.fit` against TransformerLens 4.3's `JacobianLens.fit`, on the same
model, the same prompts and the same streams, side by side in one run, and how far apart their matrices are.

    python benchmarks/bench_jacobian.py [--prompts 4] [--tokens 128] [--repeats 5] [--threads 2] [--sweep 4,8,16]

The model is the embedded one (GPT-2 shape: 6 blocks, d_model 192, vocabulary 4096) loaded by lenskit and booted
by TransformerLens' `TransformerBridge.boot_transformers` from the same folder (offline). The prompts are windows
of `--tokens` ids of standard-library text. TransformerLens's fit takes strings and tokenizes them itself (and
prepends BOS); here its `to_tokens` is handed the same windows by index, so both fit on identical ids.
Both fit TransformerLens's default source layers 0..n_layers-2 (block outputs), lenskit's streams 1..n_layers-1,
each at its own default dim_batch unless told otherwise. Every round runs every case once, the order alternating,
and the medians are kept. `--sweep` adds lenskit at other dim_batch values (how DIM_BATCH was chosen).
Writes benchmarks/jacobian_speed.csv and benchmarks/logs/jacobian.txt (this output); results.md is left alone.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything loads from the local folder; never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lenskit  # noqa: E402
from lenses import JacobianLens  # noqa: E402
from lenses.jacobian import DIM_BATCH  # noqa: E402
from lenskit.io.data import load_token_stream  # noqa: E402

FILES = ("copy.py", "base64.py", "gzip.py", "enum.py", "typing.py", "argparse.py")
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per fit")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dim-batch", type=int, default=DIM_BATCH, help="lenskit's dim_batch (default: its DIM_BATCH)")
    ap.add_argument("--tl-dim-batch", type=int, default=8, help="TransformerLens's dim_batch (default: its default, 8)")
    ap.add_argument("--sweep", default="", help="more lenskit dim_batch values to time, e.g. 4,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis import JacobianLens as TLJacobianLens

    logging.getLogger("transformer_lens").setLevel(logging.ERROR)
    folder = Path(lenskit.DEFAULT_MODEL)
    model = lenskit.HookedTransformer.from_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(str(folder), device="cpu").eval()
    root = Path(sysconfig.get_paths()["stdlib"])
    stream = load_token_stream([str(root / f) for f in FILES if (root / f).is_file()], model.tokenizer)
    windows = stream.windows(args.tokens)[: args.prompts]  # [prompts, tokens]
    if len(windows) < args.prompts:
        raise SystemExit(f"the reference text holds {len(windows)} windows of {args.tokens} tokens; ask for fewer --prompts")
    # TransformerLens's fit calls model.to_tokens(prompt): hand it the same ids, by index.
    bridge.to_tokens = lambda prompt, **kwargs: windows[int(prompt)][None]
    keys = [str(i) for i in range(len(windows))]
    n = model.cfg.n_layers
    streams = list(range(1, n))  # TransformerLens's default source layers 0..n-2

    # name -> (the fit, returning {TransformerLens layer: J}, its dim_batch)
    cases = {
        "transformer_lens": (lambda: TLJacobianLens.fit(bridge, keys, corpus="stdlib", dim_batch=args.tl_dim_batch,
                                                        show_progress=False).jacobians, args.tl_dim_batch),
        "lenskit": (lambda: _ours(model, windows, streams, args.dim_batch), args.dim_batch),
    }
    for b in sorted({int(x) for x in args.sweep.split(",") if x.strip()} - {args.dim_batch}):
        cases[f"lenskit_dim_batch_{b}"] = (lambda b=b: _ours(model, windows, streams, b), b)

    load_start = os.getloadavg()[0]
    say(f"# bench_jacobian.py, {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, threads {args.threads}")
    say(f"model: the embedded GPT-2 ({n} blocks, d_model {model.cfg.d_model}, vocabulary {model.cfg.d_vocab}); "
        f"{args.prompts} prompts x {args.tokens} tokens; streams {streams} (TransformerLens layers {[s - 1 for s in streams]}); "
        f"dim_batch lenskit {args.dim_batch}, TransformerLens {args.tl_dim_batch}; {args.repeats} rounds")
    results = {name: fn() for name, (fn, _) in cases.items()}  # warm-up, and the matrices compared below
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.repeats):  # interleaved, the order alternating, so that a slow minute slows all alike
        order = list(cases) if r % 2 == 0 else list(cases)[::-1]
        for name in order:
            start = time.perf_counter()
            cases[name][0]()
            times[name].append(time.perf_counter() - start)
        say(f"round {r}: " + ", ".join(f"{name} {times[name][-1]:.2f} s" for name in cases))

    reference = results["transformer_lens"]
    tl_median = statistics.median(times["transformer_lens"])
    rows = []
    for name in cases:
        median = statistics.median(times[name])
        diff = max(((results[name][l] - J).abs().max() / J.abs().max()).item() for l, J in reference.items())
        per_round = statistics.median(t / u for t, u in zip(times[name], times["transformer_lens"]))
        rows.append(dict(case=name, prompts=args.prompts, tokens=args.tokens, threads=args.threads,
                         dim_batch=cases[name][1],
                         median_s=round(median, 4), s_per_prompt=round(median / args.prompts, 4),
                         ratio_to_tl=round(median / tl_median, 3), median_round_ratio=round(per_round, 3),
                         max_rel_diff_J=f"{diff:.2e}"))
    say()
    say("| case | dim_batch | median s | s / prompt | time / TransformerLens | median of per-round ratios | max rel. diff of J |")
    say("|---|---|---|---|---|---|---|")
    for row in rows:
        say(f"| {row['case']} | {row['dim_batch']} | {row['median_s']:.2f} | {row['s_per_prompt']:.3f} | {row['ratio_to_tl']:.2f} "
            f"| {row['median_round_ratio']:.2f} | {row['max_rel_diff_J']} |")
    ours = next(r for r in rows if r["case"] == "lenskit")
    say()
    say(f"lenskit / TransformerLens time: {ours['ratio_to_tl']:.2f} (target <= 0.5); median of per-round ratios "
        f"{ours['median_round_ratio']:.2f}; one-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")

    out = ROOT / "benchmarks"
    with open(out / "jacobian_speed.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "jacobian.txt").write_text("\n".join(LINES) + "\n")
    print(f"wrote {out / 'jacobian_speed.csv'} and {out / 'logs' / 'jacobian.txt'}")


def _ours(model: lenskit.HookedTransformer, windows: torch.Tensor, streams: list[int], dim_batch: int) -> dict[int, torch.Tensor]:
    """lenskit's fit, as {TransformerLens layer: J} (layer = stream - 1)."""
    lens = JacobianLens.fit(model, windows, skip_first_positions=16, streams=streams, dim_batch=dim_batch, progress=False)
    return {s - 1: lens.matrix(s) for s in streams}


if __name__ == "__main__":
    main()

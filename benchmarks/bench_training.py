"""Tuned-lens training, side by side: lenskit's `train`, the same trainer with plain autograd through the
readout (the computation before `lenses/training/step.py`), and the tuned-lens package's own loop, as it ships
(its decoding under bf16 autocast) and with autocast off (every matmul in fp32, as lenskit's on an fp32 model).

Every round times one optimiser step of each contender on the same windows (the order rotated from round to
round, so a busy minute slows all alike), plus an [N, N] @ [N, N] fp32 matmul for the machine's peak. The
report gives ratios of medians, useful GFLOP/s and their fraction of the peak, and each contender's peak RSS.

Useful FLOPs of a step, per token: the frozen forward (as `bench_cases.forward_flops`, causal attention);
per trained stream the translator's forward and weight gradient (2 x 2 d^2) and the readout's forward and
input gradient (2 x 2 d V; the unembedding is frozen, so no weight gradient).

    python benchmarks/bench_training.py                       # the embedded model, 2,048-token steps
    python benchmarks/bench_training.py --model gpt2 --tokens 512 --rounds 3   # GPT-2-small shapes, random
    python benchmarks/bench_training.py --device cuda       # the GPU row: every contender on the GPU, CUDA peaks

On a GPU every contender runs there (the package's loop puts itself on the GPU it sees), each timed call ends with
a synchronisation, peak memory is the CUDA allocator's peak above what was allocated before the call, and the
matmul peak is a bf16 [N, N] @ [N, N] on the device (its fp32 rate is tensor-core TF32-dependent).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the autograd reference the tests use
from bench_cases import MATMUL_N, ensure_model_folder, forward_flops  # noqa: E402
from references import autograd_kl  # noqa: E402

import lenses.training  # noqa: E402
import lenskit  # noqa: E402
from lenses import TunedLens  # noqa: E402
from lenses.training import Recipe, train  # noqa: E402
from lenskit.io.data import TokenStream  # noqa: E402


def autograd_kl_step(translate, readout, streams, final, scale, chunk_tokens=None):
    """Plain autograd through the readout and `forward_kl`, every stream's graph held (lens_step's contender)."""
    per_stream = autograd_kl(translate.lens, streams, final)
    (per_stream.sum() * scale).backward()
    return per_stream.detach().double()


def useful_flops(cfg, n_tokens: int, ctx: int) -> float:
    streams = cfg.n_layers
    per_token = 2 * 2 * cfg.d_model**2 + 2 * 2 * cfg.d_model * cfg.d_vocab
    return forward_flops(cfg, n_tokens // ctx, ctx, causal=True) + streams * n_tokens * per_token


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


DEVICE = torch.device("cpu")  # set by --device


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def measured(fn) -> tuple[float, float]:
    """(seconds fn says it took, GiB of memory above its level before the call, at its peak during it: the RSS on
    the CPU, the CUDA allocator on a GPU)."""
    if DEVICE.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats(DEVICE)
        before = torch.cuda.memory_allocated(DEVICE)
        seconds = fn()
        return seconds, (torch.cuda.max_memory_allocated(DEVICE) - before) / 2**30
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    before = rss_kib("VmRSS")
    seconds = fn()
    return seconds, (rss_kib("VmHWM") - before) / 2**20


def matmul_seconds() -> float:
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    a, b = (torch.randn(MATMUL_N, MATMUL_N, device=DEVICE, dtype=dtype) for _ in range(2))
    out = torch.empty(MATMUL_N, MATMUL_N, device=DEVICE, dtype=dtype)
    torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def lenskit_step(model, windows: torch.Tensor, micro_batch_tokens: int, autograd: bool) -> float:
    """One `train` step (the whole call, recipe to returned lens) on these windows."""
    n, ctx = windows.shape
    stream = TokenStream(windows.reshape(-1).clone(), n_bytes=windows.numel())
    recipe = Recipe(steps=1, ctx=ctx, tokens_per_step=n * ctx, micro_batch_tokens=micro_batch_tokens)
    saved = lenses.training.kl_step
    if autograd:
        lenses.training.kl_step = autograd_kl_step
    try:
        sync()
        t0 = time.perf_counter()
        train(TunedLens(model), stream, recipe, progress=False)
        sync()
        return time.perf_counter() - t0
    finally:
        lenses.training.kl_step = saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="'embedded' (lenskit.DEFAULT_MODEL) or 'gpt2' (random weights)")
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/lenskit/bench/gpt2-random-seed0")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip", nargs="*", default=[], help="contenders to leave out")
    parser.add_argument("--dtype", default="float32", help="lenskit's model dtype (float32 or bfloat16); the translators "
                        "stay float32; the package's loop is unchanged (its own bf16 autocast)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: every contender on that device")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)
    import transformers

    transformers.logging.set_verbosity_error()
    folder = Path(lenskit.DEFAULT_MODEL) if args.model == "embedded" else ensure_model_folder(args.model_dir, seed=0)
    model = lenskit.HookedTransformer.from_pretrained(folder, dtype=args.dtype, device=DEVICE).eval()
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).to(DEVICE).eval()
    cfg = model.cfg
    ctx = min(args.ctx, cfg.n_ctx, args.tokens)
    windows = torch.randint(0, cfg.d_vocab, (args.tokens // ctx, ctx), generator=torch.Generator().manual_seed(0))
    n_tokens = windows.numel()
    flops = useful_flops(cfg, n_tokens, ctx)

    contenders = {
        "lenskit": lambda: lenskit_step(model, windows, args.micro_batch_tokens, autograd=False),
        "lenskit_autograd": lambda: lenskit_step(model, windows, args.micro_batch_tokens, autograd=True),
    }
    if "tuned_lens" not in args.skip or "tuned_lens_fp32" not in args.skip:
        from tuned_lens_package import PackageTrainer

        package = PackageTrainer(hf, args.micro_batch_tokens)
        contenders["tuned_lens"] = lambda: package.step(windows)
        package_fp32 = PackageTrainer(hf, args.micro_batch_tokens, autocast=False)
        contenders["tuned_lens_fp32"] = lambda: package_fp32.step(windows)
    contenders = {k: v for k, v in contenders.items() if k not in args.skip}
    names = list(contenders)
    print(f"{args.model}: {cfg.n_layers} layers, d_model {cfg.d_model}, d_vocab {cfg.d_vocab}; {n_tokens} tokens a step "
          f"({len(windows)} x {ctx}), {flops / 1e9:.1f} useful GFLOP; lenskit model {args.dtype}; threads {args.threads}; "
          f"load {os.getloadavg()[0]:.2f}; device {DEVICE}"
          + (f" ({torch.cuda.get_device_name(DEVICE)})" if DEVICE.type == "cuda" else ""), flush=True)
    for fn in contenders.values():  # warm-up: first-call allocations and imports
        fn()
    times = {name: [] for name in names}
    peaks = {name: [] for name in names}
    matmul = []
    for r in range(args.rounds):
        matmul.append(matmul_seconds())
        for name in names[r % len(names):] + names[: r % len(names)]:
            seconds, peak = measured(contenders[name])
            times[name].append(seconds)
            peaks[name].append(peak)
        row = "  ".join(f"{n} {times[n][-1]:.3f}s" for n in names)
        print(f"round {r}: matmul {2 * MATMUL_N**3 / matmul[-1] / 1e9:.1f} GFLOP/s  {row}", flush=True)
    peak_flops = 2 * MATMUL_N**3 / statistics.median(matmul)
    print(f"\nload at the end {os.getloadavg()[0]:.2f}; matmul peak (median) {peak_flops / 1e9:.1f} GFLOP/s"
          f"{' (bf16)' if DEVICE.type == 'cuda' else ''}; RSS with the models loaded {rss_kib('VmRSS') / 2**20:.2f} GiB\n")
    memory = "peak CUDA memory GiB" if DEVICE.type == "cuda" else "peak RSS rise GiB"
    print(f"| contender | step s (median) | tokens/s | useful GFLOP/s | fraction of peak | {memory} | "
          "step / tuned-lens (ratio of medians) | median of per-round ratios | step / tuned-lens in fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        step = statistics.median(times[name])
        ratio = per_round = vs_fp32 = "-"
        if "tuned_lens" in times:
            ratio = f"{step / statistics.median(times['tuned_lens']):.2f}"
            per_round = f"{statistics.median(a / b for a, b in zip(times[name], times['tuned_lens'])):.2f}"
        if "tuned_lens_fp32" in times:
            vs_fp32 = f"{step / statistics.median(times['tuned_lens_fp32']):.2f}"
        fraction = statistics.median(flops / t / (2 * MATMUL_N**3 / m) for t, m in zip(times[name], matmul))
        print(f"| {name} | {step:.3f} | {n_tokens / step:,.0f} | {flops / step / 1e9:.1f} | {flops / step / peak_flops:.2f} "
              f"(per round {fraction:.2f}) | {max(peaks[name]):.2f} | {ratio} | {per_round} | {vs_fp32} |")

if __name__ == "__main__":
    main()

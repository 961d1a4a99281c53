"""The real-shape side by side on one GPU, in one run: lenskit against transformers, TransformerLens 4.3's bridge and
the tuned-lens package, on the Llama-3.2-1B shape with random bf16 weights (benchmarks/real_shape.py).

    python benchmarks/gpu_side_by_side.py                 # on a GPU; writes its section of benchmarks/results-cuda.md
    python benchmarks/gpu_side_by_side.py --tiny          # every case at a tiny shape, on the CPU too, in seconds
    python benchmarks/gpu_side_by_side.py --only forward cache generate

Cases (every contender gets the same weights and the same random ids; each case interleaves its contenders round by
round after one warm-up call, and keeps medians; on CUDA the peak is the allocator's peak above what was allocated
before the call):

- forward: `model(tokens)` against transformers' (sdpa) `model(tokens).logits`;
- cache: every `resid_post` cached, against the bridge's `run_with_cache` of the same names (time and peak memory);
- trajectory: `Trajectory.from_prompt` with the logit lens, against the bare readout with log-softmax of every
  stream of a cache taken beforehand (the floor a trajectory could reach);
- eval/train: tokens per second of `evaluate` (logit and tuned lens) against `train` on the same random windows;
- jacobian: `JacobianLens.fit` against TransformerLens's `JacobianLens.fit` (same ids, same streams);
- tuned-lens step: one `train` step against one step of the tuned-lens package's own loop (tuned_lens_package.py);
- generate: greedy generation with the KV cache against transformers' `generate`, the agreement of their tokens,
  the first position where they part, the logit margin there in bf16 and in an fp32 run of the same weights, and
  each one's cached run against its own uncached run (a cached-path difference shows there, bf16 near-ties do not).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from generation_parting import case_generate  # noqa: E402,F401 - run by name, as every case_*
from gpu_bench import LINES, Bench, driver, gib, random_ids, say, version  # noqa: E402
from real_shape import LLAMA_32_1B, LLAMA_TINY, write_llama  # noqa: E402

MARK = "## Real-shape side by side (gpu_check.sh)"
KEEP_MARKER = "<!-- Hand-written sections below: bench.py keeps everything after this line when it rewrites the file. -->"
CASES = ("forward", "cache", "trajectory", "eval", "jacobian", "step", "generate")
SIZES = {  # what each case runs at: the real shape, and a tiny one that exercises the same code in seconds
    "real": dict(shape=LLAMA_32_1B, lengths=[1024, 4096, 16384, 32768], tl_max=16384, trajectory=4096, eval_tokens=16384,
                 ctx=1024, jac_prompts=2, jac_tokens=128, jac_streams=[4, 12], dim_batch=32, step_windows=(4, 512),
                 prompt=512, new=256, repeats=3),
    "tiny": dict(shape=LLAMA_TINY, lengths=[64, 256], tl_max=256, trajectory=256, eval_tokens=1024, ctx=64, jac_prompts=2,
                 jac_tokens=32, jac_streams=[1, 3], dim_batch=16, step_windows=(4, 32), prompt=32, new=16, repeats=2),
}
# ------------------------------------------------------------------ the cases
def case_forward(b: Bench, m: dict, size: dict) -> None:
    say("\n### forward: lenskit `model(tokens)` / transformers (sdpa)\n")
    say("| tokens | lenskit s | transformers s | ratio (target <= 1.0) | lenskit peak GiB | transformers peak GiB |")
    say("|---|---|---|---|---|---|")
    for n in size["lengths"]:
        ids = random_ids(n, m["cfg"].d_vocab, b.device)
        r = b.run({"lenskit": lambda: m["ours"](ids), "transformers": lambda: m["hf"](ids).logits})
        say(f"| {n} | {r['lenskit']['s']:.4f} | {r['transformers']['s']:.4f} | {r['lenskit']['s'] / r['transformers']['s']:.2f} "
            f"| {gib(r['lenskit']['peak_gib'])} | {gib(r['transformers']['peak_gib'])} |")


def case_cache(b: Bench, m: dict, size: dict) -> None:
    say("\n### cache of every resid_post: lenskit / TransformerLens's bridge\n")
    say("| tokens | lenskit s | bridge s | ratio (target <= 0.2 at >= 4k) | lenskit peak GiB | bridge peak GiB |")
    say("|---|---|---|---|---|---|")
    from lenskit import Stream

    n_layers = m["cfg"].n_layers
    names = [Stream(i, "resid_post").hook_name(n_layers) for i in range(n_layers)]  # the same names in the bridge
    for n in size["lengths"]:
        ids = random_ids(n, m["cfg"].d_vocab, b.device)
        fns = {"lenskit": lambda: m["ours"].run_with_cache(ids, names_filter=names)}
        if n <= size["tl_max"]:
            fns["bridge"] = lambda: m["bridge"].run_with_cache(ids, names_filter=lambda name: name in names)
        r = b.run(fns)
        tl = r.get("bridge", {"s": float("nan"), "peak_gib": float("nan")})
        note = "" if "bridge" in r else f" (bridge not run past --tl-max {size['tl_max']})"
        say(f"| {n} | {r['lenskit']['s']:.4f} | {tl['s']:.4f} | {r['lenskit']['s'] / tl['s']:.3f}{note} "
            f"| {gib(r['lenskit']['peak_gib'])} | {gib(tl['peak_gib'])} |")


def case_trajectory(b: Bench, m: dict, size: dict) -> None:
    from lenses import LogitLens, Trajectory

    model, n = m["ours"], size["trajectory"]
    ids = random_ids(n, m["cfg"].d_vocab, b.device)
    from lenskit import Stream

    streams = [Stream(i).hook_name(model.cfg.n_layers) for i in range(model.cfg.n_layers + 1)]  # embeddings to the last
    _, cache = model.run_with_cache(ids, names_filter=streams, return_logits=False)

    def bare() -> None:  # every stream read out and log-softmaxed, nothing kept: the floor
        for name in streams:
            torch.log_softmax(model.readout(cache[name]).float(), dim=-1)

    r = Bench(b.device, min(b.repeats, 2)).run({"trajectory": lambda: Trajectory.from_prompt(LogitLens(model), ids),
                                                "bare readout": bare})
    say(f"\n### trajectory of a {n}-token prompt, {len(streams)} streams: lenskit `Trajectory.from_prompt` / the bare readout "
        "with log-softmax of every stream (cache taken beforehand)\n")
    say("| trajectory s | bare readout s | ratio (target <= 2) | trajectory peak GiB |")
    say("|---|---|---|---|")
    say(f"| {r['trajectory']['s']:.4f} | {r['bare readout']['s']:.4f} | {r['trajectory']['s'] / r['bare readout']['s']:.2f} "
        f"| {gib(r['trajectory']['peak_gib'])} |")


def case_eval(b: Bench, m: dict, size: dict) -> None:
    from lenses import LogitLens, TunedLens
    from lenses.evaluation import evaluate
    from lenses.training import Recipe, train
    from lenskit.io.data import TokenStream

    model, ctx, n = m["ours"], size["ctx"], size["eval_tokens"]
    ids = random_ids(n, m["cfg"].d_vocab, "cpu", seed=1)[0]
    stream = TokenStream(ids.clone(), n_bytes=n)
    steps = 2
    tuned = TunedLens(model)
    r = Bench(b.device, min(b.repeats, 2)).run({"eval-lens": lambda: evaluate(model, {"logit": LogitLens(model), "tuned": tuned}, stream, tokens=n, ctx=ctx,
                                             progress=False),
               "train-lens": lambda: train(TunedLens(model), stream, Recipe(steps=steps, ctx=ctx, tokens_per_step=n // steps),
                                           progress=False)})
    e, t = n / r["eval-lens"]["s"], n / r["train-lens"]["s"]
    say(f"\n### eval-lens / train-lens: {n} tokens in windows of {ctx}, the logit and a tuned lens at every stream\n")
    say("| eval-lens tokens/s | train-lens tokens/s | eval / train (target >= 0.8) |")
    say("|---|---|---|")
    say(f"| {e:,.0f} | {t:,.0f} | {e / t:.2f} |")


def case_jacobian(b: Bench, m: dict, size: dict) -> None:
    from transformer_lens.tools.analysis import JacobianLens as TLJacobianLens

    from lenses import JacobianLens

    model, bridge, streams = m["ours"], m["bridge"], size["jac_streams"]
    windows = random_ids(size["jac_tokens"], m["cfg"].d_vocab, b.device, seed=2, rows=size["jac_prompts"])
    bridge.to_tokens = lambda prompt, **kwargs: windows[int(prompt)][None]  # TransformerLens tokenizes: hand it our ids
    keys = [str(i) for i in range(len(windows))]
    fns = {
        "lenskit": lambda: JacobianLens.fit(model, windows, skip_first_positions=16, streams=streams,
                                            dim_batch=size["dim_batch"], progress=False),
        "transformer_lens": lambda: TLJacobianLens.fit(bridge, keys, corpus="random", source_layers=[s - 1 for s in streams],
                                                       dim_batch=size["dim_batch"], max_seq_len=size["jac_tokens"],
                                                       show_progress=False),
    }
    r = Bench(b.device, min(b.repeats, 2)).run(fns)  # seconds a fit: two rounds tell them apart
    ours, theirs = r["lenskit"]["out"], r["transformer_lens"]["out"].jacobians
    diff = max(((ours.matrix(s).float().cpu() - theirs[s - 1].float().cpu()).abs().max()
                / theirs[s - 1].float().abs().max().cpu()).item() for s in streams)
    say(f"\n### Jacobian-lens fit: {len(windows)} prompts x {size['jac_tokens']} tokens, streams {streams}, dim_batch "
        f"{size['dim_batch']}: lenskit / TransformerLens\n")
    say("| lenskit s | TransformerLens s | ratio (target <= 0.5) | max relative difference of J |")
    say("|---|---|---|---|")
    say(f"| {r['lenskit']['s']:.3f} | {r['transformer_lens']['s']:.3f} | {r['lenskit']['s'] / r['transformer_lens']['s']:.2f} "
        f"| {diff:.1e} |")


def case_step(b: Bench, m: dict, size: dict) -> None:
    from bench_training import lenskit_step
    from tuned_lens_package import PackageTrainer

    rows, ctx = size["step_windows"]
    windows = random_ids(ctx, m["cfg"].d_vocab, "cpu", seed=3, rows=rows)
    package = PackageTrainer(m["hf"], micro_batch_tokens=rows * ctx)  # its own loop, its bf16 autocast, on our device
    r = b.run({"lenskit": lambda: lenskit_step(m["ours"], windows, rows * ctx, autograd=False),
               "tuned-lens": lambda: package.step(windows)})
    say(f"\n### one tuned-lens step of {rows * ctx} tokens ({rows} x {ctx}): lenskit `train` / the tuned-lens package's loop\n")
    say("| lenskit s | tuned-lens s | ratio | lenskit peak GiB | tuned-lens peak GiB |")
    say("|---|---|---|---|---|")
    say(f"| {r['lenskit']['s']:.3f} | {r['tuned-lens']['s']:.3f} | {r['lenskit']['s'] / r['tuned-lens']['s']:.2f} "
        f"| {gib(r['lenskit']['peak_gib'])} | {gib(r['tuned-lens']['peak_gib'])} |")


# ------------------------------------------------------------------ the run
def load(folder: Path, device: torch.device, cases: list[str]) -> dict:
    import transformers

    import lenskit

    transformers.logging.set_verbosity_error()
    m = {"folder": folder, "ours": lenskit.HookedTransformer.from_pretrained(folder, dtype="bf16", device=device)}
    m["cfg"] = m["ours"].cfg
    if {"forward", "step", "generate"} & set(cases):
        m["hf"] = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                                   attn_implementation="sdpa").to(device).eval()
    if {"cache", "jacobian"} & set(cases):
        from transformer_lens.model_bridge import TransformerBridge

        logging.getLogger("transformer_lens").setLevel(logging.ERROR)
        m["bridge"] = TransformerBridge.boot_transformers(str(folder), device=device, dtype=torch.bfloat16).eval()
    return m


def write_section(path: Path) -> None:
    """This run's section of `path` (results-cuda.md), after bench.py's marker so that bench.py keeps it; the
    previous section of this script is replaced, the rest of the file kept."""
    text = path.read_text() if path.exists() else f"# lenskit on a GPU\n\n{KEEP_MARKER}\n"
    if KEEP_MARKER not in text:
        text = text.rstrip("\n") + f"\n\n{KEEP_MARKER}\n"
    text = re.sub(rf"\n{re.escape(MARK)}\n.*?(?=\n## |\Z)", "", text, flags=re.S).rstrip("\n")
    path.write_text(text + "\n\n" + "\n".join(LINES) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape, for a CPU: the same code in seconds")
    ap.add_argument("--device", default=None, help="default: cuda when torch sees one, else cpu (with --tiny only)")
    ap.add_argument("--only", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--model-dir", type=Path, default=None, help="where the random checkpoint is written (kept for reruns)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the report to write this section into (default: benchmarks/results-cuda.md on a GPU at the real "
                         "shape; nothing with --tiny)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and not args.tiny:
        print("gpu_side_by_side: the real shape needs a GPU (no CUDA device here); --tiny runs every case on the CPU")
        return 2
    size = SIZES["tiny" if args.tiny else "real"]
    folder = args.model_dir or Path.home() / ".cache/lenskit/bench" / ("llama-tiny-random" if args.tiny else "llama-3.2-1b-shape-random")
    started = time.perf_counter()
    write_llama(folder, size["shape"], device=str(device))
    import transformers

    gpu = f"{torch.cuda.get_device_name(device)}, driver {driver()}" if device.type == "cuda" else platform.processor() or "CPU"
    say(MARK)
    say()
    say(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {gpu}; torch {torch.__version__} (CUDA "
        f"{torch.version.cuda}), transformers {transformers.__version__}, transformer-lens {version('transformer-lens')}, "
        f"tuned-lens {version('tuned-lens')}. Model: {'TINY test shape, not a measurement' if args.tiny else 'the Llama-3.2-1B shape'} "
        f"({size['shape']['num_hidden_layers']} blocks, d_model {size['shape']['hidden_size']}, vocabulary "
        f"{size['shape']['vocab_size']:,}), random bf16 weights, every contender on {device}.")
    m = load(folder, device, args.only)
    bench = Bench(device, size["repeats"])
    failed = []
    out = args.out or (None if args.tiny else HERE / "results-cuda.md")
    for name in CASES:
        if name not in args.only:
            continue
        start = time.perf_counter()
        try:
            # no_grad, not inference_mode: tables a forward caches (rotary) must stay usable by the fits' backward
            grad_free = name not in ("eval", "jacobian", "step")  # they train or differentiate
            with torch.no_grad() if grad_free else torch.enable_grad():
                globals()[f"case_{name}"](bench, m, size)
        except Exception as e:  # noqa: BLE001 - one case failing must not lose the others' numbers
            failed.append(name)
            say(f"\n### {name}: FAILED ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        print(f"[{name} took {time.perf_counter() - start:.1f} s]", flush=True)
        if out is not None:
            write_section(out)  # after every case: a run stopped by its time limit keeps what it measured
    say(f"\n{len(args.only)} cases in {time.perf_counter() - started:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if out is not None:
        write_section(out)
        print(f"wrote the section of {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Long contexts, side by side in one run: caching every resid_post, a logit-lens trajectory and one block's
attention pattern in lenskit, against TransformerLens 4.3's bridge caching every resid_post.

    python benchmarks/bench_long_context.py [--tokens 1024 4096 8192 16384] [--device cpu] [--tl-max 8192]

The model is a tiny random Llama (d_model 256, 4 blocks, 8 heads of 32, GQA 2 kv heads, vocabulary 32,000,
n_ctx 32,768) written once under ~/.cache/lenskit/bench. Every (case, length) runs in a fresh process: one
untimed warm-up call up to 2,048 tokens, then the median of --repeats timed calls (--long-repeats past 4,096
tokens, where one call is seconds to minutes of work); peak memory is the process's resident-set high
water mark (VmHWM, reset after loading) above its size after loading, or on CUDA the allocator's peak above the
model. TransformerLens' bridge forces eager attention (so its hooks can see every pattern); past --tl-max
tokens it would not fit this machine's memory, and those cells say so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from real_shape import write_gpt2_tokenizer  # noqa: E402

FOLDER = Path.home() / ".cache/lenskit/bench/llama-long-context"
CASES = ("lenskit_cache_resid_post", "lenskit_cache_resid_post_no_logits", "lenskit_logit_lens_trajectory",
         "lenskit_cache_one_pattern", "transformer_lens_cache_resid_post")


def write_model(folder: Path) -> Path:
    if (folder / "tokenizer.json").exists() and len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) > 1:
        return folder  # (an empty vocabulary is what an older version of this script wrote: rewritten)
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=688, vocab_size=32000, max_position_embeddings=32768,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    # TransformerLens boots only with a tokenizer: GPT-2's real BPE, offline (the benchmark's ids are random and
    # below 32,000, so the vocabularies need not agree).
    return write_gpt2_tokenizer(folder)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def one_case(case: str, n_tokens: int, device: str, repeats: int) -> dict:
    """Run in the child: load, warm up, time, and measure the peak above the loaded model."""
    from lenses import LogitLens, Trajectory
    from lenskit import HookedTransformer

    tokens = torch.randint(0, 32000, (1, n_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    if case.startswith("transformer_lens"):
        import logging

        from transformer_lens.model_bridge import TransformerBridge

        logging.getLogger("transformer_lens").setLevel(logging.ERROR)
        model = TransformerBridge.boot_transformers(str(FOLDER), device=device).eval()
        names = [f"blocks.{l}.hook_resid_post" for l in range(4)]
        call = lambda: model.run_with_cache(tokens, names_filter=lambda n: n in names)  # noqa: E731
    else:
        model = HookedTransformer.from_pretrained(FOLDER, device=device).eval()
        if case == "lenskit_cache_resid_post":
            call = lambda: model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_post"))  # noqa: E731
        elif case == "lenskit_cache_resid_post_no_logits":  # the unembedding skipped: nothing reads the logits
            call = lambda: model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_post"),  # noqa: E731
                                                return_logits=False)
        elif case == "lenskit_logit_lens_trajectory":
            lens = LogitLens(model)
            call = lambda: Trajectory.from_prompt(lens, tokens)  # noqa: E731
        else:
            call = lambda: model.run_with_cache(tokens, names_filter="blocks.2.attn.hook_pattern")  # noqa: E731
    with torch.no_grad():
        if n_tokens <= 2048:  # a first call's one-off costs matter only next to a short prompt's work
            call()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
            base = _rss_kib("VmRSS") * 1024
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = call()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            del out
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else _rss_kib("VmHWM") * 1024
    return {"case": case, "tokens": n_tokens, "seconds": statistics.median(times), "peak_mib": (peak - base) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-repeats", type=int, default=1, help="timed calls past 4,096 tokens")
    ap.add_argument("--tl-max", type=int, default=8192, help="longest prompt TransformerLens is given (memory)")
    ap.add_argument("--pattern-max", type=int, default=8192, help="longest prompt the one-pattern case is given")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--csv", type=Path, default=HERE / "long_context.csv")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_case(args.child[0], int(args.child[1]), args.device, args.repeats)))
        return
    write_model(FOLDER)
    rows = []
    for n in args.tokens:
        for case in args.cases:
            limit = args.tl_max if case.startswith("transformer_lens") else args.pattern_max if "pattern" in case else None
            if limit is not None and n > limit:
                rows.append({"case": case, "tokens": n, "seconds": float("nan"), "peak_mib": float("nan"),
                             "note": f"not run: past --{'tl' if 'transformer' in case else 'pattern'}-max={limit}"})
                continue
            repeats = args.repeats if n <= 4096 else args.long_repeats
            run = subprocess.run([sys.executable, __file__, "--child", case, str(n), "--device", args.device,
                                  "--repeats", str(repeats)], capture_output=True, text=True)
            if run.returncode != 0:
                note = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1][:120]
                rows.append({"case": case, "tokens": n, "seconds": float("nan"), "peak_mib": float("nan"), "note": note})
            else:
                rows.append({**json.loads(run.stdout.strip().splitlines()[-1]), "note": ""})
            r = rows[-1]
            print(f"{r['tokens']:>6} {r['case']:<34} {r['seconds']:>8.3f} s {r['peak_mib']:>9.1f} MiB {r['note']}", flush=True)
    import pandas as pd

    table = pd.DataFrame(rows)
    table.to_csv(args.csv, index=False)
    wide = table.pivot(index="tokens", columns="case", values="seconds")
    print("\nseconds per call")
    print(wide.round(3).to_string())
    if "lenskit_cache_resid_post" in wide:
        print("\neach case / lenskit_cache_resid_post")
        print((wide.div(wide["lenskit_cache_resid_post"], axis=0)).round(2).to_string())
    print("\npeak MiB above the loaded model")
    print(table.pivot(index="tokens", columns="case", values="peak_mib").round(1).to_string())


if __name__ == "__main__":
    main()

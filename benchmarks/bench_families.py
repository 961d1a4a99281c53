"""A Llama-shaped model of GPT-2-small size: our forward vs transformers (sdpa), the cost of caching
every residual write, and the cost of the NaN/inf check at load. One process, interleaved rounds.

    python benchmarks/bench_families.py --repeats 5 --folder /tmp/llama-small

Prints a markdown section for benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import transformers

from lenskit import HookedTransformer

SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048,
             vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)


def ensure_folder(folder: Path) -> Path:
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(folder)
    return folder


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def residual_writes(n_layers: int) -> list[str]:
    """The hook names of every residual write of every block: what the caching rows cache."""
    return [f"blocks.{i}.hook_{p}" for i in range(n_layers)
            for p in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")]


def interleaved_times(cases: dict, repeats: int) -> dict[str, list[float]]:
    """Each case's seconds per call over `repeats` rounds, after one warm-up call each, the cases interleaved round
    by round so that a slow minute slows all alike; under inference_mode. Shared with bench_moe.py."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for fn in cases.values():
            fn()  # warm-up
        for _ in range(repeats):
            for name, fn in cases.items():
                times[name].append(timed(fn))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/lenskit-bench-llama-small"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pos", type=int, default=256)
    args = parser.parse_args()
    folder = ensure_folder(args.folder)
    load_before = os.getloadavg()[0]

    ours = HookedTransformer.from_pretrained(folder)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.pos), generator=torch.Generator().manual_seed(0))
    names = residual_writes(SHAPE["num_hidden_layers"])
    with torch.inference_mode():
        gap = (ours(tokens) - hf(tokens).logits).abs().max().item()
    cases = {
        "lenskit_forward": lambda: ours(tokens),
        "transformers_forward": lambda: hf(tokens).logits,
        "lenskit_cache_all_resid": lambda: ours.run_with_cache(tokens, names_filter=names),
    }
    times = interleaved_times(cases, args.repeats)

    # Without the check, loading only maps the file: no weight is read until the first forward. So the
    # fair figure is load + a first short forward (both variants then have read every weight once).
    short = tokens[:1, :16]
    loads: dict[str, list[float]] = {k: [] for k in ("load_with_check", "load_without_check",
                                                     "load_and_first_forward_with_check", "load_and_first_forward_without_check")}

    def load_and_run(check: bool) -> None:
        with torch.inference_mode():
            HookedTransformer.from_pretrained(folder, check_finite=check)(short)

    HookedTransformer.from_pretrained(folder)  # page cache warm
    for _ in range(args.repeats):
        for suffix, check in (("with_check", True), ("without_check", False)):
            loads[f"load_{suffix}"].append(timed(lambda: HookedTransformer.from_pretrained(folder, check_finite=check)))
            loads[f"load_and_first_forward_{suffix}"].append(timed(lambda: load_and_run(check)))
    med = {k: statistics.median(v) for k, v in {**times, **loads}.items()}
    load_after = os.getloadavg()[0]

    print("## Model families: a Llama-shaped model of GPT-2-small size\n")
    print(f"Produced by `python benchmarks/bench_families.py --repeats {args.repeats}` on {time.strftime('%Y-%m-%d %H:%M')}: "
          f"LlamaForCausalLM, d_model 768, 12 layers, 12 query / 4 key-value heads, SwiGLU d_mlp 2048, vocab 32000, "
          f"random init, fp32, CPU, torch {torch.__version__} with {torch.get_num_threads()} threads, transformers "
          f"{transformers.__version__} (sdpa). Tokens {args.batch}x{args.pos}, {args.repeats} interleaved rounds after a "
          f"warm-up, medians. One-minute load average {load_before:.1f} at the start and {load_after:.1f} at the end "
          f"(2 cores, shared with other work: noisy). max|logits - transformers| = {gap:.1e}.\n")
    print("| metric | value | target | met |\n|---|---|---|---|")
    fwd = med["lenskit_forward"] / med["transformers_forward"]
    cache = med["lenskit_cache_all_resid"] / med["lenskit_forward"]
    check = med["load_and_first_forward_with_check"] / med["load_and_first_forward_without_check"]
    raw = med["load_with_check"] / med["load_without_check"]
    print(f"| forward / transformers forward | {fwd:.3f} | <= 1.0 | {fwd <= 1.0} |")
    print(f"| run_with_cache(every residual write) / own forward | {cache:.3f} | <= 1.05 | {cache <= 1.05} |")
    print(f"| load + first forward (1x16), with / without the NaN-inf check | {check:.3f} | a few percent | {check <= 1.05} |")
    print(f"| from_pretrained alone, with / without the check (without it, no weight is read yet) | {raw:.1f} | - | - |\n")
    rounds = [(f / t, c / f) for f, t, c in zip(times["lenskit_forward"], times["transformers_forward"],
                                                 times["lenskit_cache_all_resid"])]
    print("As a check on noise, the median of the per-round ratios: forward / transformers "
          f"{statistics.median(r[0] for r in rounds):.3f} (rounds: {', '.join(f'{r[0]:.3f}' for r in rounds)}); "
          f"cache / forward {statistics.median(r[1] for r in rounds):.3f}.\n")
    print("| case | median ms |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:,.0f} |")


if __name__ == "__main__":
    main()

"""A Mixtral-shaped mixture of experts (8 experts, top-2, d_model 512), fp32 on the CPU: our forward vs
transformers' (its default experts kernel, and its eager one), and run_with_cache of every residual write vs
our forward. One process, interleaved rounds, medians; targets: forward <= 1.0x transformers, caching <= 1.05x.

    python benchmarks/bench_moe.py --repeats 7

Prints a markdown section for benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import transformers
from bench_families import interleaved_times, residual_writes  # benchmarks/ is the script's folder, so on sys.path

from lenskit import HookedTransformer

SHAPE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1792,
             num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096,
             tie_word_embeddings=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--pos", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE)).eval()  # sdpa, its default experts
    hf_eager = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE, experts_implementation="eager")).eval()
    hf_eager.load_state_dict(hf.state_dict())
    ours = HookedTransformer.from_hf(hf)
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.pos), generator=torch.Generator().manual_seed(0))
    names = residual_writes(SHAPE["num_hidden_layers"])
    with torch.inference_mode():
        gap = max((ours(tokens) - hf(tokens).logits).abs().max().item(),
                  (ours(tokens) - hf_eager(tokens).logits).abs().max().item())
    cases = {
        "lenskit_forward": lambda: ours(tokens),
        "transformers_forward": lambda: hf(tokens).logits,
        "transformers_forward_eager_experts": lambda: hf_eager(tokens).logits,
        "lenskit_cache_all_resid": lambda: ours.run_with_cache(tokens, names_filter=names),
    }
    times = interleaved_times(cases, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}

    print("## Mixture of experts: a Mixtral-shaped model (benchmarks/bench_moe.py)\n")
    print(f"{SHAPE['num_hidden_layers']} blocks, d_model {SHAPE['hidden_size']}, {SHAPE['num_local_experts']} experts "
          f"of width {SHAPE['intermediate_size']}, top-{SHAPE['num_experts_per_tok']}, GQA 8/2, vocabulary "
          f"{SHAPE['vocab_size']}; fp32, CPU, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__} (default experts kernel: "
          f"{hf.config._experts_implementation}); batch {args.batch} x {args.pos} tokens; median of {args.repeats} "
          f"interleaved rounds; load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after. "
          f"Largest logit gap to transformers: {gap:.2g}.\n")
    print("| case | median s | ratio |")
    print("|---|---|---|")
    print(f"| lenskit forward | {med['lenskit_forward']:.3f} | 1.00 |")
    print(f"| transformers forward (default experts) | {med['transformers_forward']:.3f} | "
          f"lenskit / this = {med['lenskit_forward'] / med['transformers_forward']:.2f} |")
    print(f"| transformers forward (eager experts) | {med['transformers_forward_eager_experts']:.3f} | "
          f"lenskit / this = {med['lenskit_forward'] / med['transformers_forward_eager_experts']:.2f} |")
    print(f"| lenskit run_with_cache, every residual write | {med['lenskit_cache_all_resid']:.3f} | "
          f"this / lenskit forward = {med['lenskit_cache_all_resid'] / med['lenskit_forward']:.2f} |")


if __name__ == "__main__":
    main()

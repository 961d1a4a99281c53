"""A Nemotron-H-shaped Mamba-2 hybrid (Mamba-2, attention and squared-ReLU MLP layers, d_model 512), fp32 on the
CPU: our forward vs transformers' `NemotronHForCausalLM` on its torch path (neither mamba-ssm nor causal-conv1d
installed), and run_with_cache of every residual write vs our forward. One process, interleaved rounds, medians;
targets (issue 36): forward <= 1.0x transformers', caching every residual write <= 1.0x our forward (the cache keeps
the tensors the forward makes anyway, without copies; read ratios to about +-5%).

    python benchmarks/bench_mamba2.py --repeats 7

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

PATTERN = "M-M*-M-M-"  # 9 layers: four Mamba-2, one attention, four MLP
SHAPE = dict(hidden_size=512, layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp"}[c]
                                                 for c in PATTERN],
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1536, mamba_num_heads=16,
             mamba_head_dim=64, ssm_state_size=64, n_groups=4, conv_kernel=4, chunk_size=128, vocab_size=32000,
             max_position_embeddings=8192, tie_word_embeddings=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--pos", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    transformers.logging.set_verbosity_error()

    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**SHAPE)).eval()  # sdpa attention
    ours = HookedTransformer.from_hf(hf)
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.pos), generator=torch.Generator().manual_seed(0))
    names = residual_writes(len(PATTERN))
    with torch.inference_mode():
        gap = (ours(tokens) - hf(tokens).logits).abs().max().item()
    cases = {
        "lenskit_forward": lambda: ours(tokens),
        "transformers_forward": lambda: hf(tokens).logits,
        "lenskit_cache_all_resid": lambda: ours.run_with_cache(tokens, names_filter=names),
    }
    times = interleaved_times(cases, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}

    print("## Mamba-2 hybrid: a Nemotron-H-shaped model (benchmarks/bench_mamba2.py)\n")
    print(f"Layers {PATTERN} (M Mamba-2, * attention, - MLP), d_model {SHAPE['hidden_size']}, Mamba-2: "
          f"{SHAPE['mamba_num_heads']} heads of {SHAPE['mamba_head_dim']}, state {SHAPE['ssm_state_size']}, "
          f"{SHAPE['n_groups']} groups, chunks of {SHAPE['chunk_size']}; vocabulary {SHAPE['vocab_size']}; fp32, CPU, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__} "
          f"(torch path); batch {args.batch} x {args.pos} tokens; median of {args.repeats} interleaved rounds; load "
          f"average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after. Largest logit gap to transformers: "
          f"{gap:.2g}.\n")
    print("| case | median s | ratio | target |")
    print("|---|---|---|---|")
    print(f"| lenskit forward | {med['lenskit_forward']:.3f} | 1.00 | |")
    print(f"| transformers forward (torch path) | {med['transformers_forward']:.3f} | "
          f"lenskit / this = {med['lenskit_forward'] / med['transformers_forward']:.2f} | <= 1.0 |")
    print(f"| lenskit run_with_cache, every residual write ({len(names)} tensors) | "
          f"{med['lenskit_cache_all_resid']:.3f} | "
          f"this / lenskit forward = {med['lenskit_cache_all_resid'] / med['lenskit_forward']:.2f} | <= 1.0 |")


if __name__ == "__main__":
    main()

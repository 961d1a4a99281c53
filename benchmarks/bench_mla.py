"""Multi-head latent attention: a DeepSeek-V3-shaped small model (latent q and kv, a shared rotated key part, YaRN;
the first block dense, then 16 sigmoid-routed experts in 4 groups, top-2, plus a shared expert), fp32 on the CPU, one
thread: our forward vs transformers' own `DeepseekV3ForCausalLM` on its torch path (sdpa; its default experts
kernel, and its eager one), and run_with_cache of every residual write vs our forward. One process, interleaved
rounds, medians; targets: forward <= 1.0x transformers, caching <= 1.0x (issue 36).

    python benchmarks/bench_mla.py --repeats 7

Prints a markdown section for benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import transformers
from bench_families import residual_writes  # benchmarks/ is the script's folder, so on sys.path

from lenskit import HookedTransformer

# DeepSeek V3's proportions at d_model 512: 8 heads of 32 + 16 (rotary) query/key features and 32 value features,
# latents of 192 (q) and 128 (kv), experts a quarter of the dense MLP's width, a vocabulary 18 times d_model
SHAPE = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024,
             vocab_size=9216, max_position_embeddings=4096, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=2,
             moe_intermediate_size=256, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
             tie_word_embeddings=False,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024,
                                  mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))


def interleaved_times(cases: dict, repeats: int) -> tuple[dict[str, list[float]], ...]:
    """Each case's wall seconds, this thread's CPU seconds and the process's page faults per call over `repeats`
    rounds, after one warm-up call each, interleaved round by round, under inference_mode. With one torch thread, the
    CPU seconds leave out the time spent waiting for a core, which on a shared machine is most of the noise in the wall
    seconds. Each timed call follows an untimed call of its own case: a call that drops much memory (a cache) lets
    glibc's allocator hand it back to the system, and the call after it pays to fault its memory in again, so
    without this the order of the cases, not the cases, would decide who pays."""
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    faults: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for fn in cases.values():
            fn()  # warm-up
        for r in range(repeats):
            for name in list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]:  # the order rotates
                cases[name]()  # untimed: the timed call finds the memory as its own case left it
                f, w, c = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter(), time.thread_time()
                cases[name]()
                cpu[name].append(time.thread_time() - c)
                wall[name].append(time.perf_counter() - w)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
    return wall, cpu, faults


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--pos", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    load_before = os.getloadavg()[0]

    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)).eval()  # sdpa, default experts
    with torch.no_grad():
        for layer in hf.model.layers[SHAPE["first_k_dense_replace"]:]:  # a trained model's bias steers the choice
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.3)
    hf_eager = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**SHAPE, experts_implementation="eager")).eval()
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
    wall, cpu, faults = interleaved_times(cases, args.repeats)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    print("## Multi-head latent attention: a DeepSeek-V3-shaped model (benchmarks/bench_mla.py)\n")
    print(f"{SHAPE['num_hidden_layers']} blocks (the first dense), d_model {SHAPE['hidden_size']}, "
          f"{SHAPE['num_attention_heads']} heads of {SHAPE['qk_nope_head_dim']} + {SHAPE['qk_rope_head_dim']} "
          f"query/key and {SHAPE['v_head_dim']} value features, latents {SHAPE['q_lora_rank']} (q) and "
          f"{SHAPE['kv_lora_rank']} (kv), YaRN; {SHAPE['n_routed_experts']} experts of width "
          f"{SHAPE['moe_intermediate_size']} in {SHAPE['n_group']} groups, top-{SHAPE['num_experts_per_tok']} within the "
          f"best {SHAPE['topk_group']}, one shared; vocabulary {SHAPE['vocab_size']}; fp32, CPU, torch "
          f"{torch.__version__} ({torch.get_num_threads()} thread(s)), transformers {transformers.__version__} (sdpa, "
          f"default experts kernel: {hf.config._experts_implementation}); batch {args.batch} x {args.pos} tokens; median "
          f"of {args.repeats} interleaved rounds; load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after. "
          f"Largest logit gap to transformers: {gap:.2g}.\n")
    forward, cache = "lenskit_forward", "lenskit_cache_all_resid"
    rows = [("lenskit forward", forward, "1.00", "1.00"),
            *((f"transformers forward ({kind} experts)", case, *(f"lenskit / this = {m[forward] / m[case]:.2f}"
                                                                 for m in (med, med_cpu)))
              for kind, case in (("default", "transformers_forward"), ("eager", "transformers_forward_eager_experts"))),
            ("lenskit run_with_cache, every residual write", cache,
             *(f"this / lenskit forward = {m[cache] / m[forward]:.2f}" for m in (med, med_cpu)))]
    print("| case | median wall s | ratio (wall) | median CPU s | ratio (CPU) |")
    print("|---|---|---|---|---|")
    for label, case, ratio_wall, ratio_cpu in rows:
        print(f"| {label} | {med[case]:.3f} | {ratio_wall} | {med_cpu[case]:.3f} | {ratio_cpu} |")
    print("\nTargets: forward ≤ 1.0x transformers' (default experts), caching every residual write ≤ 1.0x the forward. "
          "Per-round CPU-time ratios, as a check on noise: forward / transformers "
          f"{', '.join(f'{f / t:.2f}' for f, t in zip(cpu[forward], cpu['transformers_forward']))}; cache / forward "
          f"{', '.join(f'{c / f:.2f}' for c, f in zip(cpu[cache], cpu[forward]))}. Median page faults per call: "
          f"{', '.join(f'{k} {statistics.median(v):.0f}' for k, v in faults.items())}.")

if __name__ == "__main__":
    main()

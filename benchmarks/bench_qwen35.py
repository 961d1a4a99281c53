"""Qwen 3.5 side by side: a Qwen-3.5-shaped tiny model (three Gated DeltaNet blocks, then one gated full-attention
block, twice) at 4,096 tokens, lenskit's forward against transformers' own `Qwen3_5ForCausalLM` on its torch path
(neither fla nor causal-conv1d installed); then one linear-attention layer alone at 1k, 4k and 16k tokens, lenskit's
and transformers', to show that its time and peak memory grow linearly with the prompt.

Interleaved rounds, `torch.inference_mode()`, medians. Peak memory is the accelerator's high-water mark where the
layer runs on one, else the growth of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs
just before the call) over its resident set then, in a fresh process per (layer, length).

    python benchmarks/bench_qwen35.py                       # prints a markdown section
    python benchmarks/bench_qwen35.py --device cuda --lengths 1024,4096,16384,65536
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from lenskit import HookedTransformer

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
             linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=65536, tie_word_embeddings=True,
             rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                  mrope_section=[11, 11, 10], mrope_interleaved=True))


def build(device: str):
    """transformers' random Qwen-3.5-shaped model (seed 0) and lenskit's conversion of it, both in eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE)).eval().to(device)
    return hf, HookedTransformer.from_hf(hf).to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def forward_row(device: str, pos: int, rounds: int) -> dict:
    hf, ours = build(device)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, pos), generator=torch.Generator().manual_seed(1)).to(device)
    cases = {"lenskit": lambda: ours(tokens), "transformers": lambda: hf(tokens).logits}
    with torch.inference_mode():
        err = float((cases["lenskit"]().float() - cases["transformers"]().float()).abs().max())
        times = {k: [] for k in cases}
        for r in range(rounds):
            for k in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
                times[k].append(timed(cases[k], device))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"pos": pos, **{f"{k}_s": v for k, v in med.items()}, "ratio": med["lenskit"] / med["transformers"],
            "max_abs_diff": err}


def layer_child(which: str, pos: int, device: str, rounds: int) -> dict:
    """One linear-attention layer (block 0's) on [1, pos, d_model]: median time and peak extra memory."""
    hf, ours = build(device)
    layer = ours.blocks[0].attn if which == "lenskit" else hf.model.layers[0].linear_attn
    x = torch.randn(1, pos, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(2)).to(device)
    with torch.inference_mode():
        layer(x[:, :64])  # warm-up on a short prompt, so the peak below is the long one's
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from the current one
            base = _status_bytes("VmRSS")
        times = [timed(lambda: layer(x), device) for _ in range(rounds)]
        peak = (torch.cuda.max_memory_allocated() if device.startswith("cuda") else _status_bytes("VmHWM")) - base
    return {"layer": which, "pos": pos, "seconds": statistics.median(times), "peak_bytes": peak}


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (kB there), in bytes."""
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def layer_rows(lengths: list[int], device: str, rounds: int, threads: int) -> list[dict]:
    rows = []
    for pos in lengths:
        for which in ("lenskit", "transformers"):
            out = subprocess.run([sys.executable, __file__, "--child", which, str(pos), "--device", device,
                                  "--rounds", str(rounds), "--threads", str(threads)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--pos", type=int, default=4096, help="prompt length of the whole-model comparison")
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths of the linear-attention layer alone")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", nargs=2, metavar=("WHICH", "POS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(layer_child(args.child[0], int(args.child[1]), args.device, args.rounds)))
        return 0
    row = forward_row(args.device, args.pos, args.rounds)
    print(f"## Qwen 3.5 (hybrid linear attention), {args.device}, {args.threads} thread(s)\n")
    print(f"Qwen-3.5-shaped random model: {json.dumps({k: v for k, v in SHAPE.items() if k != 'rope_parameters'})}\n")
    print("| prompt | lenskit (s) | transformers, torch path (s) | lenskit / transformers | max abs logit diff |")
    print("|---|---|---|---|---|")
    print(f"| 1 x {row['pos']} | {row['lenskit_s']:.3f} | {row['transformers_s']:.3f} | {row['ratio']:.2f}x | "
          f"{row['max_abs_diff']:.1e} |\n")
    rows = layer_rows([int(n) for n in args.lengths.split(",")], args.device, args.rounds, args.threads)
    print("One Gated DeltaNet layer alone (block 0), 1 x pos tokens:\n")
    print("| pos | lenskit (s) | lenskit peak (MiB) | transformers (s) | transformers peak (MiB) | lenskit s per 1k tokens |")
    print("|---|---|---|---|---|---|")
    for pos in sorted({r["pos"] for r in rows}):
        ours, theirs = (next(r for r in rows if r["pos"] == pos and r["layer"] == w) for w in ("lenskit", "transformers"))
        print(f"| {pos} | {ours['seconds']:.3f} | {ours['peak_bytes'] / 2**20:.1f} | {theirs['seconds']:.3f} | "
              f"{theirs['peak_bytes'] / 2**20:.1f} | {ours['seconds'] / pos * 1000:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Loading big bf16 checkpoints: lenskit's `from_pretrained` against transformers 5's, side by side.

Two random-weight checkpoints in the Hugging Face layout, bf16, sharded, written once outside the checkout
(default ~/.cache/lenskit/bench/load-*): GPT-2-large-shaped (1.44 GiB) and Llama-3.2-1B-shaped (2.3 GiB).
Every load runs in a fresh subprocess, in interleaved rounds, with the files already in the page cache:

- load seconds: `HookedTransformer.from_pretrained(folder, dtype="bfloat16")` against
  `AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)`;
- peak anonymous memory: RssAnon (/proc/self/status) sampled every millisecond by a thread during the load,
  minus RssAnon just before it, over the weights' bytes (memory-mapped file pages are not anonymous);
- the same load with `check_finite=False`, to show what the NaN/inf check costs;
- the first forward of 1 x 16 tokens after the load (it faults the mapped pages in).

    python benchmarks/bench_loading.py              # prints a markdown section; --csv writes the raw rows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SHAPES = {"gpt2-large": "gpt2-large", "llama-3.2-1b": "llama-3.2-1b"}
SHARD_BYTES = 500 * 2**20

CHILD = r"""
import os, sys, threading, time, json
os.environ["HF_HUB_OFFLINE"] = "1"
import torch, transformers
from lenskit import HookedTransformer
transformers.logging.set_verbosity_error()
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
who, folder = sys.argv[1], sys.argv[2]

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)

base = anon()
peak[0] = base
thread = threading.Thread(target=sample, daemon=True)
thread.start()
t0 = time.perf_counter()
if who == "transformers":
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
else:
    model = HookedTransformer.from_pretrained(folder, dtype="bfloat16", check_finite=(who == "lenskit"))
load = time.perf_counter() - t0
stop.set(); thread.join()
peak[0] = max(peak[0], anon())
tokens = torch.arange(16).unsqueeze(0)
t0 = time.perf_counter()
with torch.inference_mode():
    model(tokens)
first = time.perf_counter() - t0
print(json.dumps(dict(load_s=load, peak_anon=peak[0] - base, first_forward_s=first)))
"""


# ------------------------------------------------------------------ the checkpoints
def hf_config(preset: str) -> dict:
    from lenskit import ModelConfig

    cfg = ModelConfig.from_name(preset)
    if cfg.family == "gpt2":
        return {**cfg.to_hf_dict(), "torch_dtype": "bfloat16"}
    return {  # the published Llama-3.2-1B config.json, as transformers writes it
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_model // cfg.n_heads, "vocab_size": cfg.d_vocab,
        "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope.base,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16", "initializer_range": 0.02,
    }


def ensure_checkpoint(folder: Path, preset: str, seed: int = 0) -> Path:
    """Random bf16 weights under the checkpoint's own names and stored shapes, in ~500 MiB shards (written once)."""
    from safetensors.torch import save_file

    from lenskit import HookedTransformer, ModelConfig
    from lenskit.families import family_of
    from lenskit.io.loading import expected_shapes, hf_name_map

    if (folder / "model.safetensors.index.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_name(preset)
    shapes = expected_shapes(HookedTransformer, cfg)
    layout = family_of(cfg.family).layout
    gen = torch.Generator().manual_seed(seed)
    weight_map, shard, shard_bytes, n, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, shard_bytes, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes, n = {}, 0, n + 1

    for theirs, ours in hf_name_map(cfg, shapes).items():
        key = theirs if theirs == layout.top["unembed.weight"] else layout.prefix + theirs
        shape = layout.stored_shape(ours, shapes[ours])
        if ours.endswith("weight") and len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)  # norm gains
        else:
            tensor = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[key] = tensor
        shard_bytes += tensor.numel() * 2
        total += tensor.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (folder / "config.json").write_text(json.dumps(hf_config(preset), indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def weight_bytes(folder: Path) -> int:
    return json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


def warm_page_cache(folder: Path) -> None:
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def run_child(who: str, folder: Path, threads: int) -> dict:
    env = {**os.environ, "BENCH_THREADS": str(threads), "PYTHONPATH": str(HERE.parent)}
    out = subprocess.run([sys.executable, "-c", CHILD, who, str(folder)], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{who} load of {folder} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each: every loader once, fresh process)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    p.add_argument("--root", type=Path, default=Path.home() / ".cache" / "lenskit" / "bench")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--csv", type=Path, default=None, help="write the raw per-load rows here")
    args = p.parse_args(argv)
    whos = ["lenskit", "lenskit_unchecked", "transformers"]
    rows = []
    load0 = os.getloadavg()[0]
    for shape in args.shapes.split(","):
        folder = ensure_checkpoint(args.root / f"load-{shape}-bf16", SHAPES[shape])
        warm_page_cache(folder)
        size = weight_bytes(folder)
        for r in range(args.rounds):
            k = r % len(whos)
            for who in whos[k:] + whos[:k]:
                res = run_child(who, folder, args.threads)
                rows.append(dict(shape=shape, round=r, who=who, weight_bytes=size, **res))
                print(rows[-1], file=sys.stderr)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"Load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; {args.rounds} interleaved rounds, a fresh process per load, "
          f"{args.threads} torch thread(s), files in the page cache. Medians.\n")
    print("| checkpoint | weights | loader | load s | peak RssAnon / weights | first forward s | load time / transformers |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        sub = [r for r in rows if r["shape"] == shape]
        med = {w: {k: statistics.median(r[k] for r in sub if r["who"] == w) for k in ("load_s", "peak_anon", "first_forward_s")}
               for w in whos}
        size = sub[0]["weight_bytes"]
        for w in whos:
            m = med[w]
            print(f"| {shape} | {size / 2**30:.2f} GiB | {w} | {m['load_s']:.2f} | {m['peak_anon'] / size:.3f} | "
                  f"{m['first_forward_s']:.2f} | {m['load_s'] / med['transformers']['load_s']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

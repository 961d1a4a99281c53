"""Peak memory of one call, each measurement in a fresh process so nothing earlier hides in the allocator.

    python benchmarks/bench_memory.py CASE BATCHxPOS MODEL_DIR SEED   # prints one JSON line
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from bench_cases import ModelConfig, contenders, load_lenskit, load_transformer_lens, load_transformers, make_tokens
from tqdm import tqdm


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line; the memory benchmark needs Linux")


def tensor_bytes(out) -> tuple[int, int, int]:
    """(bytes of every cached entry, bytes of distinct storages, bytes of the logits) of a case's result."""
    logits, cache = (out, {}) if isinstance(out, torch.Tensor) else out
    values = [v for v in dict(cache.items()).values() if isinstance(v, torch.Tensor)]
    entries = sum(v.numel() * v.element_size() for v in values)
    distinct = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in values}
    logits_bytes = logits.numel() * logits.element_size() if isinstance(logits, torch.Tensor) else 0
    return entries, sum(distinct.values()), logits_bytes


def allocator_peak(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak bytes of live tensor allocations during fn(), from torch.profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # negative for frees
        peak = max(peak, live)
    return peak, out


def memory_child(case: str, shape: str, folder: Path, seed: int) -> dict:
    """Runs in a fresh process: the RSS high-water mark of one call of `case`, above the loaded model."""
    batch, pos = (int(s) for s in shape.split("x"))
    lk = load_lenskit(folder) if case.startswith("lenskit") else None
    hf = load_transformers(folder) if case.startswith("transformers") else None
    tl = load_transformer_lens(folder)[0] if case.startswith("tl") else None
    cfg = ModelConfig.from_name("gpt2")
    tokens = make_tokens(batch, pos, cfg.d_vocab, seed)
    fn = contenders(lk, hf, tl, tokens, cfg.n_layers)[case]
    with torch.inference_mode():
        contenders(lk, hf, tl, tokens[:, :8], cfg.n_layers)[case]()  # lazy one-time set-up, not measured
        gc.collect()
        base = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        out = fn()
        peak = _status_kib("VmHWM")
        entries, distinct, logits_bytes = tensor_bytes(out)
        del out
        gc.collect()
        alloc_peak, out = allocator_peak(fn)
    return dict(case=case, shape=shape, rss_peak_bytes=(peak - base) * 1024, alloc_peak_bytes=alloc_peak,
                cached_entry_bytes=entries, cached_distinct_bytes=distinct, logits_bytes=logits_bytes)


def run_memory(cases: list[str], shapes, folder: Path, seed: int, repeats: int) -> pd.DataFrame:
    rows = []
    jobs = [(c, f"{b}x{p}") for b, p in shapes for c in cases]
    for r in tqdm(range(repeats), desc="memory (fresh process each)"):
        for case, shape in jobs:
            cmd = [sys.executable, __file__, case, shape, str(folder), str(seed)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"memory child {case} {shape} failed:\n{res.stderr[-3000:]}")
            rows.append(dict(json.loads(res.stdout.strip().splitlines()[-1]), round=r))
    return pd.DataFrame(rows)


if __name__ == "__main__":
    case, shape, folder, seed = sys.argv[1:5]
    print(json.dumps(memory_child(case, shape, Path(folder), int(seed))))

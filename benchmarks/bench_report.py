"""Turning the raw timings, memory figures and profiles into results.csv and results.md."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from bench_cases import MATMUL_N, ModelConfig, forward_flops

import lenskit

# ------------------------------------------------------------------ profile
OP_GROUPS = {  # aten op -> what it is, for the "where the time goes" summary
    "aten::addmm": "matmul", "aten::mm": "matmul", "aten::bmm": "matmul", "aten::matmul": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention core (fused SDPA)",
    "aten::native_layer_norm": "layer norm", "aten::gelu": "gelu", "aten::tanh": "gelu", "aten::pow": "gelu",
    "aten::mul": "elementwise", "aten::add": "elementwise", "aten::add_": "elementwise", "aten::div": "elementwise",
    "aten::embedding": "embedding", "aten::index_select": "embedding",
    "aten::softmax": "attention core (eager)", "aten::_softmax": "attention core (eager)",
    "aten::masked_fill": "attention core (eager)", "aten::where": "attention core (eager)",
    # addmm first fills its output with the broadcast bias (a copy_), then accumulates the product into it
    "aten::copy_": "copies (bias fill, reshapes)", "aten::clone": "copies (bias fill, reshapes)",
}


def profile_case(fn: Callable[[], object]) -> pd.DataFrame:
    """Self CPU time per aten op of one call (after the timing runs, so nothing is cold)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    rows = [dict(op=e.key, calls=e.count, self_ms=e.self_cpu_time_total / 1e3) for e in prof.key_averages()]
    frame = pd.DataFrame(rows)
    frame = frame[frame.self_ms > 0].sort_values("self_ms", ascending=False)
    frame["group"] = frame.op.map(OP_GROUPS).fillna("other (python, views, allocation)")
    frame["share"] = frame.self_ms / frame.self_ms.sum()
    return frame.reset_index(drop=True)


# ------------------------------------------------------------------ summary
def _median(t: pd.DataFrame, shape: str, case: str) -> float:
    s = t[(t["shape"] == shape) & (t.case == case)].seconds
    return float(s.median()) if len(s) else float("nan")


def _paired(t: pd.DataFrame, shape: str, num: str, den: str) -> float:
    """Median over rounds of the per-round ratio: a check that the ratio of medians is not noise."""
    w = t[t["shape"] == shape].pivot(index="round", columns="case", values="seconds")
    return float((w[num] / w[den]).median()) if num in w and den in w else float("nan")


def summarize(t: pd.DataFrame, mem: pd.DataFrame | None, cfg: ModelConfig, shapes) -> pd.DataFrame:
    """One tidy row per (metric, shape): value, target, whether it is met, and what it means."""
    rows = []

    def add(metric, shape, value, target=None, ok=None, note=""):
        rows.append(dict(metric=metric, shape=shape, value=value, target=target,
                         met=None if ok is None or value != value else bool(ok), note=note))

    peak = 2 * MATMUL_N**3 / _median(t, "-", "matmul_peak")
    add("d.matmul_peak_gflops", "-", peak / 1e9, note=f"[{MATMUL_N}x{MATMUL_N}] @ [{MATMUL_N}x{MATMUL_N}] fp32")
    for batch, pos in shapes:
        sh = f"{batch}x{pos}"
        for case in sorted(t[t["shape"] == sh].case.unique()):
            add(f"median_ms.{case}", sh, 1e3 * _median(t, sh, case))
        fwd, hf = _median(t, sh, "lenskit_forward"), _median(t, sh, "transformers_forward")
        cache, tl = _median(t, sh, "lenskit_cache"), _median(t, sh, "tl_cache")
        r = fwd / hf
        add("a.forward_vs_transformers", sh, r, "<= 1.02", r <= 1.02, "lenskit forward / transformers forward")
        add("a.paired", sh, _paired(t, sh, "lenskit_forward", "transformers_forward"), note="median per-round ratio")
        r = cache / fwd
        add("c.cache_overhead", sh, r, "<= 1.05", r <= 1.05, "run_with_cache(all residual writes) / own forward")
        add("c.paired", sh, _paired(t, sh, "lenskit_cache", "lenskit_forward"), note="median per-round ratio")
        r = cache / tl
        add("b.cache_vs_transformer_lens", sh, r, "<= 0.95", r <= 0.95, "lenskit cache / TransformerLens cache")
        add("b.paired", sh, _paired(t, sh, "lenskit_cache", "tl_cache"), note="median per-round ratio")
        flops = forward_flops(cfg, batch, pos)
        add("d.forward_gflop", sh, flops / 1e9, note="2 x weights multiplied per token + full Q K^T and pattern V")
        for case, secs in (("lenskit_forward", fwd), ("transformers_forward", hf)):
            add(f"d.gflops.{case}", sh, flops / secs / 1e9)
            add(f"d.fraction_of_peak.{case}", sh, flops / secs / peak)
        causal = forward_flops(cfg, batch, pos, causal=True)
        add("d.fraction_of_peak_causal_count.lenskit_forward", sh, causal / fwd / peak,
            note="counting only the keys a query sees")
        if mem is not None and len(mem):
            m = mem[mem["shape"] == sh].groupby("case").median(numeric_only=True)
            for impl in ("lenskit", "tl"):
                if f"{impl}_cache" not in m.index:
                    continue
                c, f = m.loc[f"{impl}_cache"], m.loc[f"{impl}_forward"]
                extra_rss = c.rss_peak_bytes - f.rss_peak_bytes
                extra_alloc = c.alloc_peak_bytes - f.alloc_peak_bytes
                target = ("<= 1.2", extra_rss / c.cached_entry_bytes <= 1.2) if impl == "lenskit" else (None, None)
                add(f"e.{impl}.cached_entry_mib", sh, c.cached_entry_bytes / 2**20, note="sum over cache entries")
                add(f"e.{impl}.cached_distinct_mib", sh, c.cached_distinct_bytes / 2**20,
                    note="distinct storages (resid_post[i] is resid_pre[i+1])")
                add(f"e.{impl}.cache_peak_rss_mib", sh, extra_rss / 2**20, note="RSS high-water: cache run - forward run")
                add(f"e.{impl}.cache_peak_over_cached", sh, extra_rss / c.cached_entry_bytes, *target)
                add(f"e.{impl}.cache_peak_alloc_mib", sh, extra_alloc / 2**20,
                    note="torch allocator peak: cache run - forward run")
                add(f"e.{impl}.forward_peak_rss_mib", sh, f.rss_peak_bytes / 2**20, note="whole forward incl. logits")
    return pd.DataFrame(rows)


# ------------------------------------------------------------------- report
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _fmt(v) -> str:
    if isinstance(v, float):
        return "n/a" if v != v else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}")
    return "" if v is None else str(v)


def markdown_table(frame: pd.DataFrame) -> str:
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def profile_summary(profiles: dict[str, pd.DataFrame], summary: pd.DataFrame, cfg: ModelConfig, shapes) -> str:
    out = []
    peak = summary.loc[summary.metric == "d.matmul_peak_gflops", "value"].iloc[0]  # GFLOP/s
    for key, prof in profiles.items():
        case, sh = key.split("@")
        batch, pos = (int(s) for s in sh.split("x"))
        groups = prof.groupby("group").self_ms.sum().sort_values(ascending=False)
        total = groups.sum()
        shares = ", ".join(f"{g} {100 * ms / total:.1f}%" for g, ms in groups.items() if ms / total >= 0.005)
        line = f"- `{case}` {sh}: {total:,.0f} ms of op self time: {shares}."
        mm_ms = groups.get("matmul", 0.0)
        if mm_ms:
            mm_flops = forward_flops(cfg, batch, pos) - 4 * cfg.n_layers * pos * cfg.n_heads * cfg.d_head * batch * pos
            line += (f" The matmuls alone run at {mm_flops / mm_ms / 1e6:,.0f} GFLOP/s "
                     f"({100 * mm_flops / mm_ms / 1e6 / peak:.0f}% of the measured peak).")
        out.append(line)
        top = prof.head(8)[["op", "calls", "self_ms", "share", "group"]]
        out.append("")
        out.append(markdown_table(top).replace("\n", "\n  ").join(["  ", ""]))
        out.append("")
    return "\n".join(out)


def write_report(out_dir: Path, args, t: pd.DataFrame, summary: pd.DataFrame, profiles, parity: dict,
                 tl_note: str, hf_attn: str, cfg: ModelConfig, shapes, started: str) -> None:
    import transformers

    try:
        from importlib.metadata import version
        tl_version = version("transformer-lens")
    except Exception:  # noqa: BLE001 - not installed
        tl_version = "not installed"
    suffix = getattr(args, "suffix", "")  # "-cuda" for a GPU run, which leaves the CPU files alone
    device = getattr(args, "device", "cpu")
    summary.to_csv(out_dir / f"results{suffix}.csv", index=False)
    t.to_csv(out_dir / f"timings{suffix}.csv", index=False)
    key = summary[summary.metric.str.match(r"^[a-e]\.") & ~summary.metric.str.contains("paired")]
    targets = key[key.target.notna()][["metric", "shape", "value", "target", "met", "note"]]
    timing = summary[summary.metric.str.startswith("median_ms.")].copy()
    timing["case"] = timing.metric.str.removeprefix("median_ms.")
    timing = timing.pivot(index="case", columns="shape", values="value").reset_index()
    paired = summary[summary.metric.str.endswith(".paired")][["metric", "shape", "value", "note"]]
    other = key[key.target.isna()][["metric", "shape", "value", "note"]]
    text = f"""# lenskit benchmark results

Produced by `{args.command}` ({started} to {time.strftime('%Y-%m-%d %H:%M')}, {args.repeats} interleaved rounds,
{args.memory_repeats} fresh processes per memory figure).

Machine: {_cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads,
transformers {transformers.__version__} (GPT2LMHeadModel, default attention implementation: `{hf_attn}`),
transformer-lens {tl_version} (TransformerBridge; it forces `eager` attention so hooks can see patterns),
lenskit {lenskit.__version__}. One-minute load average {args.load[0]:.1f} at the start and {args.load[-1]:.1f} at the end
(the machine has {os.cpu_count()} cores; anything above that means other work shared them, so timings are noisy). Weights: the `gpt2` preset with random init, one local folder that all three load
(`{args.model_dir}`). fp32, device `{device}`{_gpu_name(device)}, `torch.inference_mode()` for every call. Tokens: random ids,
batch x pos as shown.
{tl_note}
Same weights, same numbers: {', '.join(f'{k} {v:.1e}' for k, v in parity.items())}.

## Targets

{markdown_table(targets)}

## Median wall time per call (ms)

{markdown_table(timing)}

The ratios above are ratios of medians. As a check on noise, the median of the per-round ratios:

{markdown_table(paired)}

## Throughput and memory

{markdown_table(other)}

FLOPs are counted as `lenskit.accounting` counts them: 2 per multiplied weight per token (qkv, out, fc_in,
fc_out, unembed) plus the attention core `Q K^T` and `pattern V` over the full score matrix. Memory: each
figure is the RSS high-water mark of one call in a fresh process, above the process's RSS just before it
(`/proc/self/clear_refs`), median over processes; `cache_peak` is that of `run_with_cache` minus that of the plain
forward, i.e. what keeping the cache costs at the peak. The `alloc` rows count only torch's tensor allocations
(torch.profiler memory events) and so leave out the C allocator's own slack.

## Where the time goes (torch.profiler, one call after the timing rounds)

{profile_summary(profiles, summary, cfg, shapes)}
"""
    report = out_dir / f"results{suffix}.md"
    (out_dir / f"results{suffix}.md").write_text(text + kept_sections(report), encoding="utf-8")


KEEP_MARKER = "<!-- Hand-written sections below: bench.py keeps everything after this line when it rewrites the file. -->"


def kept_sections(report: Path) -> str:
    """What follows KEEP_MARKER in the existing report (the marker included), so that a rerun loses nothing
    written by hand or appended by the other benchmarks; a report without the marker keeps nothing."""
    if not report.exists():
        return "\n" + KEEP_MARKER + "\n"
    old = report.read_text(encoding="utf-8")
    at = old.find(KEEP_MARKER)
    return "\n" + (old[at:] if at >= 0 else KEEP_MARKER + "\n")


def _gpu_name(device: str) -> str:
    return f" ({torch.cuda.get_device_name()})" if device.startswith("cuda") and torch.cuda.is_available() else ""


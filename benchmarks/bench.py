"""Side-by-side speed and memory: lenskit against transformers and TransformerLens, in one run.

All three load the same local folder of GPT-2-small-shaped random weights (the `gpt2` preset, random
init, written once), run the same token batches in fp32 on the CPU, and are timed in interleaved rounds
so that a slow minute of a busy machine hits every contender alike. Reported: medians, ratios of
medians, achieved GFLOP/s against a matmul peak measured in the same run, the cache's peak memory
(each measurement in a fresh subprocess) and a profile of where the forward's time goes.

    python benchmarks/bench.py                 # full run: benchmarks/results.md, results.csv, timings.csv
    python benchmarks/bench.py --repeats 3     # a quick look

TransformerLens is optional (`pip install -e .[bench]`); without it its rows are left out and the
report says why.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything loads from the local folder; never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pandas as pd
import torch
from tqdm import tqdm

import lenskit
from lenskit import HookedGPT2, ModelConfig

HERE = Path(__file__).resolve().parent
RESID_WRITES = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
MATMUL_N = 2048  # the peak: an [N, N] @ [N, N] fp32 matmul, 2 N^3 FLOPs


def resid_names(n_layers: int) -> list[str]:
    """Every residual write: the five stream hooks of every block."""
    return [f"blocks.{i}.{h}" for i in range(n_layers) for h in RESID_WRITES]


# ------------------------------------------------------------------ the weights
def ensure_model_folder(folder: Path, seed: int) -> Path:
    """The gpt2 preset with GPT-2's random init, saved once in the Hugging Face layout."""
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    torch.manual_seed(seed)
    HookedGPT2(ModelConfig.from_name("gpt2")).save_pretrained(folder)
    return folder


def load_lenskit(folder: Path) -> HookedGPT2:
    return HookedGPT2.from_pretrained(folder).eval()


def load_transformers(folder: Path):
    import transformers

    transformers.logging.set_verbosity_error()
    # The default attention implementation (no attn_implementation argument): what a user gets.
    return transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()


def load_transformer_lens(folder: Path):
    """TransformerLens' TransformerBridge over the same folder, or the reason it cannot be had."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError as e:
        return None, f"transformer-lens is not installed ({e}); `pip install -e .[bench]`"
    import logging

    logging.getLogger("transformer_lens").setLevel(logging.ERROR)
    try:
        return TransformerBridge.boot_transformers(str(folder), device="cpu").eval(), ""
    except Exception as e:  # noqa: BLE001 - any failure to boot is reported, not fatal to the benchmark
        return None, f"TransformerBridge.boot_transformers failed offline: {type(e).__name__}: {e}"


def make_tokens(batch: int, pos: int, d_vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


# -------------------------------------------------------------------- the work
def contenders(lk, hf, tl, tokens: torch.Tensor, n_layers: int) -> dict[str, Callable[[], object]]:
    """What is timed, by name, for the models given (None skips one); each returns what a caller keeps."""
    names = resid_names(n_layers)
    wanted = set(names)
    cases: dict[str, Callable[[], object]] = {}
    if hf is not None:
        cases["transformers_forward"] = lambda: hf(tokens).logits
    if lk is not None:
        cases["lenskit_forward"] = lambda: lk(tokens)
        cases["lenskit_cache"] = lambda: lk.run_with_cache(tokens, names_filter=names)
    if tl is not None:
        cases["tl_forward"] = lambda: tl(tokens)
        cases["tl_cache"] = lambda: tl.run_with_cache(tokens, names_filter=lambda n: n in wanted)
    return cases


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    with torch.inference_mode():
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    del out
    return seconds


def matmul_case(n: int = MATMUL_N) -> Callable[[], object]:
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    b = torch.randn(n, n, generator=torch.Generator().manual_seed(1))
    return lambda: a @ b


def forward_flops(cfg: ModelConfig, batch: int, pos: int, causal: bool = False) -> float:
    """Matmul FLOPs of one forward, counted as lenskit.accounting does (Kaplan et al.'s conventions).

    2 FLOPs per multiplied weight per token (qkv, out, fc_in, fc_out, unembed), plus the attention core
    (`Q K^T` and `pattern V`): 4 * n_layers * n_keys * d_attn per token, with n_keys = pos for the full
    score matrix, or the causal mean (pos + 1) / 2 when `causal`.
    """
    d, d_attn = cfg.d_model, cfg.n_heads * cfg.d_head
    weights_per_block = d * 3 * d_attn + d_attn * d + 2 * d * cfg.d_mlp
    dense = 2 * (cfg.n_layers * weights_per_block + d * cfg.d_vocab)
    n_keys = (pos + 1) / 2 if causal else pos
    return batch * pos * (dense + 4 * cfg.n_layers * n_keys * d_attn)


def run_timings(lk, hf, tl, shapes, repeats: int, warmup: int, seed: int) -> pd.DataFrame:
    """Interleaved rounds: each round runs every case once, in an order rotated round by round."""
    cases: list[tuple[str, str, Callable[[], object]]] = [("-", "matmul_peak", matmul_case())]
    for batch, pos in shapes:
        tokens = make_tokens(batch, pos, lk.cfg.d_vocab, seed)
        for name, fn in contenders(lk, hf, tl, tokens, lk.cfg.n_layers).items():
            cases.append((f"{batch}x{pos}", name, fn))
    for _, _, fn in tqdm(cases, desc="warm-up", leave=False):
        for _ in range(warmup):
            timed(fn)
    rows = []
    with tqdm(total=repeats * len(cases), desc="timing (interleaved rounds)") as bar:
        for r in range(repeats):
            k = r % len(cases)
            for shape, name, fn in cases[k:] + cases[:k]:
                rows.append(dict(round=r, shape=shape, case=name, seconds=timed(fn)))
                bar.update()
    return pd.DataFrame(rows)


# ------------------------------------------------------------------- memory
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
            cmd = [sys.executable, __file__, "--memory-child", case, "--shape", shape, "--model-dir", str(folder),
                   "--seed", str(seed)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"memory child {case} {shape} failed:\n{res.stderr[-3000:]}")
            rows.append(dict(json.loads(res.stdout.strip().splitlines()[-1]), round=r))
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ profile
OP_GROUPS = {  # aten op -> what it is, for the "where the time goes" summary
    "aten::addmm": "matmul", "aten::mm": "matmul", "aten::bmm": "matmul", "aten::matmul": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention core (fused SDPA)",
    "aten::native_layer_norm": "layer norm", "aten::gelu": "gelu", "aten::tanh": "gelu", "aten::pow": "gelu",
    "aten::mul": "elementwise", "aten::add": "elementwise", "aten::add_": "elementwise", "aten::div": "elementwise",
    "aten::embedding": "embedding", "aten::index_select": "embedding",
    "aten::softmax": "attention core (eager)", "aten::_softmax": "attention core (eager)",
    "aten::masked_fill": "attention core (eager)", "aten::where": "attention core (eager)",
    "aten::copy_": "copies", "aten::clone": "copies", "aten::contiguous": "copies",
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
    add("matmul_peak_gflops", "-", peak / 1e9, note=f"[{MATMUL_N}x{MATMUL_N}] @ [{MATMUL_N}x{MATMUL_N}] fp32")
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
    peak = summary.loc[summary.metric == "matmul_peak_gflops", "value"].iloc[0]
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
    summary.to_csv(out_dir / "results.csv", index=False)
    t.to_csv(out_dir / "timings.csv", index=False)
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
lenskit {lenskit.__version__}. Weights: the `gpt2` preset with random init, one local folder that all three load
(`{args.model_dir}`). fp32, CPU, `torch.inference_mode()` for every call. Tokens: random ids, batch x pos as shown.
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
    (out_dir / "results.md").write_text(text, encoding="utf-8")


# --------------------------------------------------------------------- main
def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(n) for n in s.lower().split("x")) for s in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise SystemExit(f"--shapes wants BATCHxPOS[,BATCHxPOS...], e.g. 4x256,1x1024; got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15, help="interleaved timing rounds (default 15)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls of each case first")
    p.add_argument("--memory-repeats", type=int, default=3, help="fresh processes per memory figure (0 skips)")
    p.add_argument("--shapes", default="4x256,1x1024", help="BATCHxPOS list (default 4x256,1x1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the random gpt2-shaped weights are written once (default ~/.cache/lenskit/bench)")
    p.add_argument("--out-dir", type=Path, default=HERE, help="where results.md/.csv go (default benchmarks/)")
    p.add_argument("--no-tl", action="store_true", help="leave TransformerLens out")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model_dir = args.model_dir or Path.home() / ".cache" / "lenskit" / "bench" / f"gpt2-random-seed{args.seed}"
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.shape, args.model_dir, args.seed)))
        return 0
    args.command = "python benchmarks/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.command = args.command.strip()
    started = time.strftime("%Y-%m-%d %H:%M")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shapes = parse_shapes(args.shapes)
    folder = ensure_model_folder(args.model_dir, args.seed)
    lk, hf = load_lenskit(folder), load_transformers(folder)
    tl, tl_note = (None, "TransformerLens left out (--no-tl).") if args.no_tl else load_transformer_lens(folder)
    tl_note = f"\n**TransformerLens rows missing:** {tl_note}\n" if tl is None else ""
    hf_attn = getattr(hf.config, "_attn_implementation", "unknown")

    batch, pos = shapes[0]
    tokens = make_tokens(batch, pos, lk.cfg.d_vocab, args.seed)
    names = resid_names(lk.cfg.n_layers)
    with torch.inference_mode():
        logits, cache = lk.run_with_cache(tokens, names_filter=names)
        parity = {"max|logits - transformers|": float((logits - hf(tokens).logits).abs().max())}
        if tl is not None:
            tl_logits, tl_cache = tl.run_with_cache(tokens, names_filter=lambda n: n in set(names))
            parity["max|logits - TL|"] = float((logits - tl_logits).abs().max())
            parity["max|cache - TL cache|"] = max(float((cache[n] - tl_cache[n]).abs().max()) for n in names)
    del logits, cache
    print("parity:", parity)

    t = run_timings(lk, hf, tl, shapes, args.repeats, args.warmup, args.seed)
    profiles = {}
    if not args.no_profile:
        for b, s in shapes:
            cases = contenders(lk, hf, None, make_tokens(b, s, lk.cfg.d_vocab, args.seed), lk.cfg.n_layers)
            for case in ("lenskit_forward", "lenskit_cache", "transformers_forward"):
                profiles[f"{case}@{b}x{s}"] = profile_case(cases[case])
    mem = None
    if args.memory_repeats > 0:
        mem_cases = ["lenskit_forward", "lenskit_cache"] + (["tl_forward", "tl_cache"] if tl is not None else [])
        del lk, hf, tl
        gc.collect()
        mem = run_memory(mem_cases, shapes, folder, args.seed, args.memory_repeats)
        mem.to_csv(args.out_dir / "memory.csv", index=False)
    summary = summarize(t, mem, ModelConfig.from_name("gpt2"), shapes)
    write_report(args.out_dir, args, t, summary, profiles, parity, tl_note, hf_attn,
                 ModelConfig.from_name("gpt2"), shapes, started)
    print((args.out_dir / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

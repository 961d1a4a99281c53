"""Peak memory of a logit-lens Trajectory over a 1,024-token prompt on a GPT-2-small-shaped model.

    python benchmarks/trajectory_memory.py            # prints a table; exits 1 if the bound is broken
    python benchmarks/trajectory_memory.py --naive    # also measure holding every layer's logits at once

The model is the `gpt2` preset (12 layers, d_model 768, d_vocab 50,257) with random weights: memory
does not depend on the weights. The bound to stay under is the model plus ONE layer's full logits
(1,024 x 50,257 float32 = 206 MB); holding all 13 streams' logits would need 2.7 GB.

Method. tracemalloc does not see torch's allocations, so we read the kernel's own accounting of the
process: /proc/self/status VmHWM, the peak resident set size. Writing "5" to /proc/self/clear_refs
resets that peak to the current RSS, so each measurement is "peak RSS during the call minus RSS just
before it", with the model already loaded. A thread sampling VmRSS every millisecond cross-checks it
(and replaces it where clear_refs is not allowed). Each row runs in its own fresh process, so one
measurement's freed-but-cached memory cannot hide the next one's peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

N_POS = 1024
MB = 1e6


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status; this benchmark needs Linux")


def measure(fn) -> dict:
    """Run fn(); return peak RSS increase (bytes) over the RSS before it, by VmHWM reset and by sampling."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        hwm_ok = True
    except OSError:
        hwm_ok = False
    before = rss_kb("VmRSS")
    peak_sampled = before
    done = threading.Event()

    def sample():
        nonlocal peak_sampled
        while not done.is_set():
            peak_sampled = max(peak_sampled, rss_kb("VmRSS"))
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    done.set()
    t.join()
    peak = rss_kb("VmHWM") if hwm_ok else peak_sampled
    return dict(peak_extra=(peak - before) * 1024, sampled_extra=(peak_sampled - before) * 1024, seconds=seconds,
                method="VmHWM" if hwm_ok else "sampled VmRSS")


def child(what: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import torch

    import lenskit
    from lenses import LogitLens, Trajectory

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = lenskit.ModelConfig.from_name("gpt2")
    model = lenskit.HookedTransformer(cfg).eval()  # random init; the weights do not change memory
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.randint(0, cfg.d_vocab, (1, N_POS))
    lens = LogitLens(model)

    def run(tokens: torch.Tensor):
        if what == "trajectory":
            return Trajectory.from_prompt(lens, tokens, top_k=5)
        if what == "forward":  # the model's own forward: it materialises the final layer's logits
            return model(tokens)
        if what == "naive":  # every stream's full logits at once, as a logit lens without care would
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: "resid" in n)
            return torch.stack([lens(h, l) for l, h in enumerate(cache.accumulated_resid())])
        raise ValueError(what)

    with torch.no_grad():
        run(tokens[:, :32])  # warm-up on a short prompt: one-off allocations (thread pools, kernels) are not the call's
        result = measure(lambda: run(tokens))
    print(json.dumps(dict(what=what, model_bytes=model_bytes, logits_bytes=N_POS * cfg.d_vocab * 4,
                          n_layers=cfg.n_layers, **result)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--naive", action="store_true", help="also measure holding all layers' logits (2.7 GB)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    rows = []
    for what in ["forward", "trajectory"] + (["naive"] if args.naive else []):
        out = subprocess.run([sys.executable, __file__, "--child", what], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    r = {row["what"]: row for row in rows}
    model_b, logits_b = rows[0]["model_bytes"], rows[0]["logits_bytes"]
    bound = model_b + logits_b
    print(f"GPT-2-small-shaped random model ({rows[0]['n_layers']} layers, d_vocab 50,257), one prompt of {N_POS} tokens, "
          f"fp32 CPU; peak RSS above the loaded model ({rows[0]['method']})\n")
    print(f"| {'what':<48} | {'MB':>8} |")
    print(f"|{'-' * 50}|{'-' * 10}|")
    print(f"| {'model parameters':<48} | {model_b / MB:8.1f} |")
    print(f"| {'one layer of full logits (1024 x 50257 x 4 B)':<48} | {logits_b / MB:8.1f} |")
    print(f"| {'bound: model + one layer of logits':<48} | {bound / MB:8.1f} |")
    print(f"| {'all 13 streams of logits (never held)':<48} | {(rows[0]['n_layers'] + 1) * logits_b / MB:8.1f} |")
    for what, label in [("forward", "model(tokens) peak above model"), ("trajectory", "Trajectory.from_prompt peak above model"),
                        ("naive", "naive all-layer logit lens peak above model")]:
        if what in r:
            print(f"| {label:<48} | {r[what]['peak_extra'] / MB:8.1f} |")
    t = r["trajectory"]
    total = model_b + t["peak_extra"]
    print(f"\ntrajectory: model + peak = {total / MB:.1f} MB vs bound {bound / MB:.1f} MB "
          f"({t['peak_extra'] / logits_b:.2f} layers' worth of logits above the model; sampled RSS agrees: "
          f"{t['sampled_extra'] / MB:.1f} MB); {t['seconds']:.1f} s")
    if total >= bound:
        print("FAIL: the trajectory's peak is above the model plus one layer's logits", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

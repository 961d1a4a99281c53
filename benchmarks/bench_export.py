"""Static figure export: one browser per process (lenses.plots.export) against a browser per figure.

    python benchmarks/bench_export.py [--figures 6]

Draws the same lens heatmaps (the embedded model's logit lens on one prompt, PNG, SVG and PDF in turn) two ways,
each in a fresh interpreter: lenskit's `save_figure`, whose first export starts the process's one headless Chrome
and whose later ones reuse it, and kaleido's one-shot `calc_fig_sync` with no server, which starts and stops a
Chrome for every figure (what every export cost before). Prints a Markdown table of seconds per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
import torch, lenskit
from lenses import LogitLens
from lenses.trajectory import Trajectory
from lenses import plots
from lenses.plots import export

way, n = sys.argv[1], int(sys.argv[2])
model = lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")
with torch.no_grad():
    frame = Trajectory.from_prompt(LogitLens(model), "def __init__(self, name):\n    self.name = name\n").to_frame()
fig = plots.logit_lens_heatmap(frame)
out, times = Path(tempfile.mkdtemp()), []
for i in range(n):
    suffix = (".png", ".svg", ".pdf")[i % 3]
    t0 = time.perf_counter()
    if way == "one browser per process":
        plots.save_figure(fig, out / f"f{i}{suffix}")
    else:
        import kaleido
        opts = dict(format=suffix[1:], width=fig.layout.width or 900, height=fig.layout.height or 500,
                    scale=2 if suffix == ".png" else 1)
        (out / f"f{i}{suffix}").write_bytes(kaleido.calc_fig_sync(fig.to_dict(), opts=opts,
                                                                   kopts=dict(mathjax=False, timeout=600)))
    times.append(time.perf_counter() - t0)
t0 = time.perf_counter()
export.stop_export_browser()
print(json.dumps({"times": times, "close": time.perf_counter() - t0}))
"""

WAYS = ("one browser per process", "a browser per figure (kaleido one-shot)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--figures", type=int, default=6)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = {}
    for way in WAYS:
        done = subprocess.run([sys.executable, "-c", CHILD, way, str(args.figures)], capture_output=True, text=True,
                              env=env, timeout=3600, check=True)
        rows[way] = json.loads(done.stdout.strip().splitlines()[-1])
    print("| export | first figure (s) | each later figure, median (s) | slowest later (s) | closing the browser (s) |")
    print("|---|---:|---:|---:|---:|")
    for way, r in rows.items():
        later = r["times"][1:]
        print(f"| {way} | {r['times'][0]:.2f} | {statistics.median(later):.2f} | {max(later):.2f} | {r['close']:.2f} |")
    fast, slow = (statistics.median(rows[w]["times"][1:]) for w in WAYS)
    print(f"\nlater figures: {slow / fast:.0f}x faster with one browser per process ({args.figures} figures each, PNG/SVG/PDF in turn)")


if __name__ == "__main__":
    main()

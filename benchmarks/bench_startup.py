"""Start-up time of the `lenskit` command and of the imports behind it.

    python benchmarks/bench_startup.py [--runs 7]

Each case runs in a fresh interpreter, `--runs` times; the median wall time is reported (the first run
also warms the file cache, so a median is steadier than a mean). Writes benchmarks/startup.csv and
prints a table with the target `lenskit --help` < 0.5 s. The CLI is started as `python -m lenses.cli`
from this checkout (the `lenskit` script does the same through its entry point).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELP_TARGET_S = 0.5

CASES = {
    "python -c pass (the interpreter alone)": ["-c", "pass"],
    "lenskit --help": ["-m", "lenses.cli", "--help"],
    "import lenses.cli": ["-c", "import lenses.cli"],
    "import lenskit (torch, transformers)": ["-c", "import lenskit"],
    "import lenses.plots (plotly, pandas)": ["-c", "import lenses.plots"],
    "lenskit lens --help": ["-m", "lenses.cli", "lens", "--help"],
    "lenskit info (embedded model)": ["-m", "lenses.cli", "info"],
}


def time_case(args: list[str], runs: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="fresh interpreters per case (default 7)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "startup.csv"))
    args = ap.parse_args()

    rows = []
    for name, argv in CASES.items():
        times = time_case(argv, args.runs)
        rows.append(dict(case=name, median_s=statistics.median(times), min_s=min(times), max_s=max(times), runs=len(times)))
        print(f"{name:42s} median {rows[-1]['median_s']:.3f} s  (min {rows[-1]['min_s']:.3f}, max {rows[-1]['max_s']:.3f})")
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    help_s = next(r["median_s"] for r in rows if r["case"] == "lenskit --help")
    load = os.getloadavg()[0]
    print(f"\nlenskit --help: {help_s:.3f} s median, target < {HELP_TARGET_S} s: {'met' if help_s < HELP_TARGET_S else 'NOT met'} "
          f"(one-minute load average {load:.1f}); wrote {args.out}")


if __name__ == "__main__":
    main()

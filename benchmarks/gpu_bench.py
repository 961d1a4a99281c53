"""The harness of the GPU side by side (gpu_side_by_side.py): timing and peak memory of contenders, interleaved,
with a synchronisation around every timed call on a GPU; the report's lines; what the machine runs."""

from __future__ import annotations

import statistics
import subprocess
import time

import torch

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


class Bench:
    """Timing and peak memory on one device: every contender of a case, interleaved, after one warm-up each."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats, self.cuda = device, repeats, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, fns: dict) -> dict[str, dict]:
        """{name: {"s": median seconds, "peak_gib": peak above the start (CUDA), "out": the warm-up's result}}."""
        out = {}
        for name, fn in fns.items():
            self.sync()
            if self.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device) if self.cuda else 0
            result = fn()
            self.sync()
            peak = (torch.cuda.max_memory_allocated(self.device) - base) / 2**30 if self.cuda else float("nan")
            out[name] = {"out": result, "peak_gib": peak, "times": []}
        for r in range(self.repeats):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                self.sync()
                start = time.perf_counter()
                result = fns[name]()
                self.sync()
                out[name]["times"].append(time.perf_counter() - start)
                del result
        for row in out.values():
            row["s"] = statistics.median(row["times"])
        return out


def random_ids(n: int, d_vocab: int, device, seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, d_vocab, (rows, n), generator=torch.Generator().manual_seed(seed)).to(device)


def gib(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"


def driver() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as found

    try:
        return found(package)
    except PackageNotFoundError:
        return "not installed"

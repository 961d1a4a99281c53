"""Per-row statistics of a block of logits against a reference token, the inner loop of eval-lens.

For each row z [d_vocab] and reference token k (the final distribution's top-1): z[k], the largest other
logit, mass = sum_v exp(z_v - peak) and weighted = sum_v exp(z_v - peak) (z_v - peak), with peak the largest
logit, and whether argmax(z) is k. They give the log-sum-exp (peak + log mass), the entropy
(log mass - weighted / mass) and top-1 agreement of a lens at every (layer, token) without a log-softmax.

With torch ops this takes six passes over each row (amax, subtract, exp, sum, multiply, sum), three of them
writing. A small C++ kernel, `row_stats.cpp`, takes two passes and writes nothing: inside eval-lens on the
benchmark machine (two threads, 4,096 logits a row) about 0.35 ns a logit against about 0.65 for the ops. It is compiled once per
machine by torch's extension builder (ninja and a C++ compiler, about 25 s) into torch's extension cache
(TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions); `scripts/install.sh` builds it. It is built only for
x86 CPUs on which torch runs AVX2 or AVX-512 kernels, the instruction sets its vector code is compiled for.
Anywhere else, or if the build fails (said once, with the reason), the same statistics come from torch ops:
equal up to the order of the sums.

Set `FUSED = "torch"` to use the torch ops everywhere.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

import torch

FUSED = "auto"  # "auto": the C++ kernel where it can be built, else torch ops; "torch": torch ops only
# The torch-op path works on a block this many bytes at a time, so that its passes after the first read the
# rows from the core's cache: on the benchmark machine (two threads, 2 MiB L2 each) 1 MiB pieces took 2.2 ms
# per 1,024 rows of 4,096 logits, against 3.4 ms for whole 16 MiB blocks.
SUB_BYTES = 2**20
SOURCE = Path(__file__).with_name("row_stats.cpp")
# torch's CPU capability -> the compiler flags and ATen vector width the kernel is built with
FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512",
               "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}


def row_stats(z: torch.Tensor, ref: torch.Tensor, at_ref: torch.Tensor, runner_up: torch.Tensor, mass: torch.Tensor,
              weighted: torch.Tensor, agree: torch.Tensor, scratch: torch.Tensor) -> None:
    """Fills the [rows] outputs for logits z [rows, d_vocab] (float32, contiguous) and reference tokens ref [rows]:
    at_ref = z[ref], runner_up = the largest other logit (-inf if d_vocab is 1), mass and weighted as above
    (peak = max(at_ref, runner_up)), agree = argmax(z) == ref (the first maximum, as torch.argmax).

    NaN in a row makes its sums NaN, as torch's ops would. `scratch` is a float32 buffer at least as large as z,
    used by the torch-op path; that path also leaves z shifted by each row's peak, so z is not to be read after."""
    kernel = _kernel() if z.device.type == "cpu" else None
    if kernel is not None:
        kernel.row_stats(z, ref, at_ref, runner_up, mass, weighted, agree)
    else:
        _torch_row_stats(z, ref, at_ref, runner_up, mass, weighted, agree, scratch)


def _torch_row_stats(z, ref, at_ref, runner_up, mass, weighted, agree, scratch) -> None:
    ids = ref[:, None]
    torch.gather(z, 1, ids, out=at_ref[:, None])
    # One pass finds the largest other logit (max with indices, or argmax, is many times slower than amax).
    torch.amax(z.scatter_(1, ids, -torch.inf), -1, out=runner_up)
    z.scatter_(1, ids, at_ref[:, None])
    torch.gt(at_ref, runner_up, out=agree)
    tied = at_ref == runner_up
    if tied.any():  # another token shares the maximum: argmax takes the first of them
        agree[tied] = z[tied].argmax(-1) == ref[tied]
    peak = torch.maximum(runner_up, at_ref)[:, None]
    sub = max(1, SUB_BYTES // (4 * z.shape[1]))
    exps = scratch.view(-1)[: z.numel()].view(z.shape)
    for r0 in range(0, len(z), sub):  # the passes over whole rows, a few rows at a time, in the core's cache
        rows, e = z[r0: r0 + sub], exps[r0: r0 + sub]
        rows.sub_(peak[r0: r0 + sub])  # z - peak: 0 at the maximum, so exp cannot overflow
        torch.sum(torch.exp(rows, out=e), -1, out=mass[r0: r0 + sub])
        torch.sum(e.mul_(rows), -1, out=weighted[r0: r0 + sub])  # in place: a row dot product would allocate


def kernel_available() -> bool:
    """Whether `row_stats` runs the C++ kernel on CPU tensors (building it now if it is not built yet)."""
    return _kernel() is not None


def _kernel():
    if FUSED not in ("auto", "torch"):
        raise ValueError(f"lenses.row_stats.FUSED must be 'auto' or 'torch', got {FUSED!r}")
    return _built() if FUSED == "auto" else None


@functools.cache
def _built():
    """The compiled kernel module, or None where it cannot be built (said once, as a warning, with the reason)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in FLAGS:
        return None  # no vector code to build for this CPU: torch ops, silently
    try:
        return build(capability)
    except Exception as exc:  # a missing compiler or ninja, a read-only cache, a failed compile
        first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
        warnings.warn(f"lenskit: could not build the row-statistics kernel ({first[0]}); eval-lens uses torch "
                      "ops instead: the same results, that loop about twice as slow", RuntimeWarning, stacklevel=3)
        return None


def build(capability: str | None = None):
    """Compiles (once; later calls load the cached build) and returns the kernel module for this CPU."""
    from torch.utils import cpp_extension  # imported here: it costs a second at start-up

    capability = capability or torch.backends.cpu.get_cpu_capability()
    if capability not in FLAGS:
        raise RuntimeError(f"no row-statistics kernel for CPU capability {capability!r}; it needs AVX2 or AVX512")
    _put_ninja_on_path()
    name = f"lenskit_row_stats_{capability.lower()}"
    if not _is_built(cpp_extension, name):
        print(f"lenskit: compiling the row-statistics kernel for {capability} (once per machine, about 25 s)",
              file=sys.stderr, flush=True)
    return cpp_extension.load(name, [str(SOURCE)], extra_cflags=["-O3", "-fopenmp", *FLAGS[capability]],
                              extra_ldflags=["-fopenmp"], verbose=False)


def prebuild() -> None:
    """Builds the kernel now if this CPU gets one (scripts/install.sh); raises if that build fails."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in FLAGS:
        print(f"lenskit: no row-statistics kernel for CPU capability {capability}; eval-lens uses torch ops")
        return
    build(capability)
    print(f"lenskit: row-statistics kernel ready ({capability})")


def _is_built(cpp_extension, name: str) -> bool:
    """Whether torch's extension cache holds a build of `name` (only for the message: load() decides)."""
    try:  # a private helper of torch's, so any failure just means "say that it compiles"
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:
        return False
    return any(folder.glob(f"{name}*.so"))


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel puts it beside the interpreter's scripts,
    which is not on PATH when a virtual environment's python is run without activating it."""
    try:
        import ninja
    except ImportError:
        return
    folder = str(getattr(ninja, "BIN_DIR", ""))
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")

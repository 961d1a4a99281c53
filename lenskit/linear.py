"""`Linear`: nn.Linear whose half-precision matmul runs in float32 on a CPU that has no fast half-precision one.

bf16 and fp16 weights halve a model's memory. A CPU with bf16 instructions (avx512_bf16, AMX) multiplies
them natively, as fast as float32 or faster; one without emulates the half-precision GEMM, several times
slower than float32 (on the benchmark machine, a Xeon without avx512_bf16, 30 against 139 GFLOP/s on one
thread). There `Linear` upcasts the input and the weight, exactly (bf16 and fp16 values are float32 values),
multiplies in float32 and rounds the output to the weight's dtype: what a half-precision GEMM with float32
accumulation computes, up to the order of the sums, at float32 speed. The float32 copy of the weight lives
only during the call, BLOCK_BYTES of it at a time, so a large unembedding never doubles in memory. Calls
with fewer than MIN_ROWS rows (a short prompt, generation) multiply natively: there the conversion of the
weight would cost more than it saves.

Which way is faster is measured once per process and dtype, on a small matmul (`half_matmul_in_float32`);
set `HALF_MATMUL` to "native" or "float32" to choose instead. GPUs always multiply natively.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

HALF_MATMUL = "auto"  # "auto" (measure once), "native" (the dtype's own GEMM) or "float32" (upcast)
# The largest float32 copy of a weight that one call makes at once. Small enough to be reused from the heap
# (glibc maps larger blocks afresh on every call, and faulting their pages in costs more than the copy).
BLOCK_BYTES = 16 * 2**20
# Fewer rows than this multiply natively: converting the weight costs about as much as a few dozen rows of
# emulated GEMM, so a short prompt or one generated token gains nothing (a 16-token first forward of a
# Llama-3.2-1B-shaped model took 3.45 s upcast on the benchmark machine, 1.64 s native, transformers' 1.69 s).
MIN_ROWS = 256
HALF = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) with `linear`'s half-precision CPU path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), in float32 for a half-precision weight on a CPU where that is faster."""
    if (weight.dtype in HALF and weight.device.type == "cpu" and x.numel() >= MIN_ROWS * weight.shape[1]
            and half_matmul_in_float32(weight.dtype)):
        return upcast_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """`linear(x, weight, bias)` written into the float32 buffer `out` [..., out_features]: straight into it for
    float32 weights (no temporary), else computed as the layer computes it, in the weight's dtype, and upcast."""
    if weight.dtype == out.dtype:
        if bias is not None:
            return torch.addmm(bias, x, weight.t(), out=out)
        return torch.matmul(x, weight.t(), out=out)
    return out.copy_(linear(x.to(weight.dtype), weight, bias))


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in float32 on exactly upcast operands, rounded to the weight's dtype; the weight converted
    BLOCK_BYTES at a time (blocks of output features)."""
    xf = x.float()
    rows = max(1, BLOCK_BYTES // (4 * weight.shape[1]))
    if rows >= weight.shape[0]:
        return F.linear(xf, weight.float(), None if bias is None else bias.float()).to(weight.dtype)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=weight.dtype, device=x.device)
    for r0 in range(0, weight.shape[0], rows):
        r1 = min(r0 + rows, weight.shape[0])
        out[..., r0:r1] = F.linear(xf, weight[r0:r1].float(), None if bias is None else bias[r0:r1].float())
    return out


@functools.cache
def _measured_faster_in_float32(dtype: torch.dtype) -> bool:
    """Whether a [256, 512] @ [512, 512] CPU matmul is clearly faster upcast to float32 than in `dtype`
    (best of three each, after one untimed call; about 20 ms when the dtype is emulated)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=gen), torch.randn(512, 512, generator=gen)
    ah, bh = a.to(dtype), b.to(dtype)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    native = best(lambda: ah @ bh)
    upcast = best(lambda: (ah.float() @ bh.float()).to(dtype))
    return upcast * 1.3 < native


def half_matmul_in_float32(dtype: torch.dtype) -> bool:
    """Whether `linear` upcasts a CPU matmul in this half-precision dtype (see `HALF_MATMUL`)."""
    if HALF_MATMUL not in ("auto", "native", "float32"):
        raise ValueError(f"lenskit.linear.HALF_MATMUL must be 'auto', 'native' or 'float32', got {HALF_MATMUL!r}")
    if HALF_MATMUL != "auto":
        return HALF_MATMUL == "float32"
    return _measured_faster_in_float32(dtype)

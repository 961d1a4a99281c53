"""`Linear`: nn.Linear whose half-precision matmul runs in float32 on a CPU without half-precision instructions.

bf16 and fp16 weights halve a model's memory. A CPU with bf16 instructions (avx512_bf16, AMX) multiplies
bf16 natively; one without emulates the half-precision GEMM, several times slower than float32 (a Xeon
without avx512_bf16: 30 against 139 GFLOP/s on one thread, benchmarks/results.md). There `Linear`
upcasts the input and the weight, exactly (bf16 and fp16 values are float32 values), multiplies in
float32 and rounds the output to the weight's dtype: what a half-precision GEMM with float32
accumulation computes, up to the order of the sums. The float32 copy of the weight lives only during
the call, BLOCK_BYTES of it at a time, so a large unembedding never doubles in memory.

The rule, read once per process from what the CPU reports (`/proc/cpuinfo`), never from a timing or
the size of a call, so the same inputs always give the same numbers:

- bfloat16 is multiplied natively where the CPU lists `avx512_bf16` or `amx_bf16` (x86) or `bf16`
  (Arm), and upcast elsewhere;
- float16 natively where it lists `avx512_fp16` or `amx_fp16` (x86) or `fphp` (Arm), upcast elsewhere;
- where the flags cannot be read (not Linux), natively; GPUs always natively.

Set `HALF_MATMUL`, or the environment variable LENSKIT_HALF_MATMUL before lenskit is imported, to "native" or
"float32" to choose instead ("auto" is the rule): the tests run both paths on one machine that way.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("auto", "native", "float32")  # the CPU flags rule above, the dtype's own GEMM, or upcast
HALF_MATMUL = os.environ.get("LENSKIT_HALF_MATMUL", "auto")
if HALF_MATMUL not in MODES:  # refused at import, before a model computes anything on the wrong path
    raise ValueError(f"LENSKIT_HALF_MATMUL must be 'auto', 'native' or 'float32', got {HALF_MATMUL!r}; "
                     "unset it for the CPU flags rule")
# The largest float32 copy of a weight that one call makes at once. Small enough to be reused from the heap
# (glibc maps larger blocks afresh on every call, and faulting their pages in costs more than the copy).
BLOCK_BYTES = 16 * 2**20
HALF = (torch.bfloat16, torch.float16)
# CPU flags that mean a dtype has a native GEMM: x86 names, then Arm's.
NATIVE_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16", "bf16"}, torch.float16: {"avx512_fp16", "amx_fp16", "fphp"}}


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) with `linear`'s half-precision CPU path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ScaledLinear(Linear):
    """A projection whose output is times a fixed `scale` (Granite's residual multiplier on every sublayer's write):
    scale * (x W^T + b), the product taken after the matmul, as transformers takes it. Its parameters and state dict
    are nn.Linear's, the checkpoint's own; the weight views that read it (W_O, W_out) include the scale
    (`written`), so they show the write as it reaches the stream."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, scale: float = 1.0) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale}"


def write_projection(in_features: int, out_features: int, bias: bool, scale: float = 1.0) -> Linear:
    """A sublayer's output projection: a `Linear`, or a `ScaledLinear` where its write is scaled (scale != 1)."""
    if scale == 1.0:
        return Linear(in_features, out_features, bias=bias)
    return ScaledLinear(in_features, out_features, bias=bias, scale=scale)


def written(layer: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """A view `t` of `layer`'s weight or bias as the layer writes it: times its scale where it is a `ScaledLinear` (a
    copy then), `t` itself otherwise."""
    scale = getattr(layer, "scale", 1.0)
    return t if scale == 1.0 else t * scale


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), in float32 for a half-precision weight on a CPU without that dtype's GEMM."""
    if weight.dtype in HALF and weight.device.type == "cpu" and half_matmul_in_float32(weight.dtype):
        return upcast_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """`linear(x, weight, bias)` written into the float32 buffer `out` [..., out_features]: straight into it for
    float32 weights (no temporary), else computed as the layer computes it, in the weight's dtype (under
    torch.autocast, in autocast's dtype, which a call with `out=` would skip), and upcast."""
    if weight.dtype == out.dtype and not torch.is_autocast_enabled(out.device.type):
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
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (x86 `flags`, Arm `Features`); empty where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def half_matmul_in_float32(dtype: torch.dtype) -> bool:
    """Whether `linear` upcasts a CPU matmul in this half-precision dtype (see `HALF_MATMUL` and the rule above)."""
    if HALF_MATMUL not in MODES:
        raise ValueError(f"lenskit.pieces.linear.HALF_MATMUL must be 'auto', 'native' or 'float32', got {HALF_MATMUL!r}")
    if HALF_MATMUL != "auto":
        return HALF_MATMUL == "float32"
    flags = cpu_flags()
    return bool(flags) and not (flags & NATIVE_FLAGS[dtype])

"""Rows decoded against the vocabulary a chunk at a time: how many rows a chunk holds on a device, and the one
pass over a chunk's logits that the statistics are read from.

Every path that turns streams into [rows, d_vocab] logits (trajectories, evaluation and layer transfer, causal
fidelity) sizes its chunks with `chunk_rows`, writes per-row results into tensors on the device, and copies
them to the host once, after its loops: nothing inside a loop over chunks or layers waits for the device
(no `.cpu()`, `.item()`, `.tolist()`, nor a Python branch on a tensor's value). tests/test_sync.py counts.
"""

from __future__ import annotations

import torch

from lenskit.pieces.readout import Readout

from .metrics import first_max

# On CUDA a chunk's float32 [rows, d_vocab] buffers share this fraction of the memory the device has free (the
# caching allocator's idle blocks included), each buffer at most CUDA_MAX_BYTES: at 128k tokens that is 2,048
# rows, past the ~1k rows where the readout matmul runs at speed (issue 39: 0.64 s at 1,024 rows, 0.61 s at 4,096).
CUDA_FREE_FRACTION = 0.25
CUDA_MAX_BYTES = 2**30
# On the CPU the readout matmul reads the whole unembedding again for every chunk, so larger chunks are faster on a
# large vocabulary (128k tokens, d_model 256, 512 tokens, one thread: a trajectory took 24 s in chunks of 32 rows,
# 19 s of 64, 15 s of 256; benchmarks/bench_trajectory.py, results.md). Memory bounds them: a chunk's buffers together hold
# about the unembedding's bytes (each at least CPU_BYTES and CPU_MIN_ROWS rows), so decoding takes about as much
# memory as the readout's own weight (benchmarks/trajectory_memory.py: under one layer's logits on GPT-2 small).
CPU_BYTES = 8 * 2**20
CPU_MIN_ROWS = 32


def device_budget(device: torch.device | str) -> int:
    """Bytes a chunk's buffers may take on a CUDA device: CUDA_FREE_FRACTION of its free memory, the caching
    allocator's idle blocks counted as free (queried once, before a loop: it is not a sync with the stream)."""
    device = torch.device(device)
    free, _ = torch.cuda.mem_get_info(device)
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(CUDA_FREE_FRACTION * (free + idle))


def chunk_rows(readout: Readout, buffers: int = 1) -> int:
    """Rows per chunk for `buffers` float32 [rows, d_vocab] buffers of logits read out by `readout` (at least 1):
    on CUDA they share `device_budget`, each at most CUDA_MAX_BYTES; on the CPU they share the unembedding's bytes
    (see CPU_BYTES above).

    >>> chunk_rows(model.readout, buffers=4)     # stdlib-gpt2 on the CPU: four buffers of at least 8 MiB
    512
    """
    weight = readout.weight
    row_bytes = 4 * readout.d_vocab
    if weight.device.type == "cuda":
        return max(1, min(CUDA_MAX_BYTES, device_budget(weight.device) // buffers) // row_bytes)
    per_buffer = max(CPU_BYTES, weight.numel() * weight.element_size() // buffers)
    return max(CPU_MIN_ROWS, per_buffer // row_bytes)


def shifted_stats(z: torch.Tensor, e: torch.Tensor, scratch: torch.Tensor | None = None,
                  peak: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One log-softmax of the logits z [rows, d_vocab] (a float32 buffer), in the form the statistics read it:
    z is shifted in place to z - peak, so that log q = z - log_mass, and e := exp(z - peak) is written into
    the buffer `e`. Returns (top, log_mass, weighted, mass): top [rows, 1] each row's first maximum (as argmax;
    given as `peak` [rows, 1] values instead, top is None), log_mass = log sum e, weighted = sum e (z - peak),
    mass = sum e; so H(q) = log_mass - weighted / mass. Terms 0 x (-inf) count as 0 (a token of logit -inf adds
    nothing); a NaN logit makes the row's sums NaN. Without `scratch`, e is used up by the product."""
    top = None
    if peak is None:
        top = first_max(z)[:, None]
        peak = z.gather(1, top)
    z.sub_(peak)
    mass = torch.exp(z, out=e).sum(-1)
    weighted = (e.mul_(z) if scratch is None else torch.mul(e, z, out=scratch)).nansum(-1)
    return top, mass.log(), weighted, mass


def cross_term(f_e: torch.Tensor, z: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """sum e^f (z - peak) per row, for shifted lens logits z and the final's e^f = exp(z^f - peak^f): with the
    final's own (log_mass, weighted, mass), KL(final || lens) = (weighted^f - cross) / mass^f + log_mass - log_mass^f,
    exactly 0 where z = z^f."""
    return torch.mul(f_e, z, out=scratch).nansum(-1)

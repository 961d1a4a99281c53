"""The tuned-lens objective by plain autograd, the independent reference for `lenses.lens_step` (and the
benchmarks' autograd contender): per-stream KL(final || lens) through the lens's own forward."""

from __future__ import annotations

import torch

from lenses.metrics import forward_kl


def autograd_kl(lens, streams, final_logits: torch.Tensor) -> torch.Tensor:
    """streams [(s, h [batch, pos, d_model])], final logits [batch, pos, d_vocab] -> summed KL per stream [n]."""
    return torch.stack([forward_kl(final_logits, lens(h, s)).sum() for s, h in streams])

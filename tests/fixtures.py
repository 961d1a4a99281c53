"""Helpers the test modules share (conftest.py holds the shared fixtures): one home for each, imported by name."""

from __future__ import annotations

import torch


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 2e-5, rtol: float = 1e-5) -> None:
    """a equals b to float32 rounding of sums taken in another order (shape and dtype too)."""
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def random_tokens(batch: int, pos: int, seed: int, high: int = 101, low: int = 0) -> torch.Tensor:
    """[batch, pos] token ids drawn uniformly from [low, high) by a generator seeded with `seed`."""
    return torch.randint(low, high, (batch, pos), generator=torch.Generator().manual_seed(seed))


def unchanged_copy(x: torch.Tensor, hook) -> torch.Tensor:
    """A hook that returns a copy of what it got: an edit that changes no value. On hook_pattern (or the scores) it
    makes attention take its eager path, which a read-only hook does not (lenskit.pieces.attention)."""
    return x.clone()

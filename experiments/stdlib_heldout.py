"""Held-out text for the experiments: the standard-library files the embedded model never trained on.

The split is the training script's own (`lenskit.io.data.is_heldout`: one file in twenty by a
hash of its path), so these windows are text the model has not seen.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lenskit.io.data import Document, is_heldout, stdlib_files, tokenize_documents  # noqa: E402


def heldout_windows(tokenizer, n_windows: int, ctx: int, seed: int = 0) -> torch.Tensor:
    """`n_windows` windows [n_windows, ctx] of held-out stdlib tokens, chosen at random (by `seed`)
    among the non-overlapping windows of the held-out files joined by end-of-text tokens."""
    docs = [Document(rel, path.read_text(encoding="utf-8", errors="replace"))
            for rel, path in stdlib_files() if is_heldout(rel)]
    if not docs:
        raise FileNotFoundError("no held-out standard-library files found; is this Python's stdlib installed?")
    tokens = tokenize_documents(docs, tokenizer)
    n = len(tokens) // ctx
    if n < n_windows:
        raise ValueError(f"the held-out text has {n} windows of {ctx} tokens, fewer than the {n_windows} asked for")
    windows = tokens[: n * ctx].view(n, ctx)
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:n_windows]
    return windows[pick.sort().values]

"""What the tests and the benchmarks share and the library does not need: the tuned-lens objective by plain
autograd (the independent reference for `lenses.training.step`, and the benchmarks' autograd contender), the
list of every residual-stream hook, and TransformerLens 4.3 (the bench extra) as a peer to compare with."""

from __future__ import annotations

import torch

from lenses.metrics import forward_kl
from lenskit.observe.stream import POINTS, block_hook_name


def autograd_kl(lens, streams, final_logits: torch.Tensor) -> torch.Tensor:
    """streams [(s, h [batch, pos, d_model])], final logits [batch, pos, d_vocab] -> summed KL per stream [n]."""
    return torch.stack([forward_kl(final_logits, lens(h, s)).sum() for s, h in streams])


def resid_writes(n_layers: int) -> list[str]:
    """Every residual-stream hook of every block (each point of `lenskit.observe.stream.POINTS`), block by block."""
    return [block_hook_name(layer, suffix) for layer in range(n_layers) for suffix in POINTS.values()]


def transformer_lens_4_3():
    """transformer_lens, at 4.3 or later, with its logging quietened; the calling test is skipped where it is not
    installed (it comes with the bench extra, `pip install -e .[bench]`)."""
    import logging
    from importlib.metadata import PackageNotFoundError, version

    import pytest

    try:
        release = tuple(int(x) for x in version("transformer-lens").split(".")[:2])
    except PackageNotFoundError:
        release = ()
    if release < (4, 3):
        pytest.skip("needs TransformerLens 4.3 or later (pip install -e .[bench])")
    import transformer_lens

    logging.getLogger("transformer_lens").setLevel(logging.ERROR)
    return transformer_lens

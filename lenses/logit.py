"""The logit lens (nostalgebraist, 2020): decode any residual vector with the model's own final norm and unembedding.

Stream `l` (0..n_layers) is the residual stream after `l` blocks. Beyond the block boundaries, the
logit lens also reads the middle of a block (`Stream(l, "resid_mid")`) and what each sublayer writes
(`attn_out`, `mlp_out`): the final norm is then recomputed on that write alone, so the logits say
which tokens the write by itself pushes up.
"""

from __future__ import annotations

import torch

from lenskit import Stream
from lenskit.observe.stream import POINTS as STREAM_POINTS

from .base import BasisLens

# Points of a block that can be read through a lens (see `lenskit.Stream`).
POINTS = tuple(STREAM_POINTS)


class LogitLens(BasisLens):
    """`unembed(ln_final(h))` for the stream after any number of blocks, with no trained parameters.

    The final norm's scale is recomputed on every `h` it reads. (Reusing the last layer's cached
    scale, a bug TransformerLens once shipped, mis-scales every earlier layer.)

    >>> lens = LogitLens(model)
    >>> logits, cache = model.run_with_cache(tokens)
    >>> lens(cache.stream(2), 2).shape                           # stream after 2 blocks: [batch, pos, d_vocab]
    torch.Size([1, 13, 4096])
    >>> lens.decode(cache, Stream(2, "mlp_out")).shape           # what block 2's MLP writes, read alone
    torch.Size([1, 13, 4096])
    >>> torch.allclose(lens(cache.stream(6), 6), logits, atol=1e-4)   # after the last block: the model's logits
    True
    """

    name = "logit"

    def transform_hidden(self, h: torch.Tensor, s: Stream) -> torch.Tensor:
        return h  # the logit lens reads every stream as if it were the last one

    def reads_as_model(self, s: Stream) -> bool:
        return True

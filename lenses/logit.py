"""The logit lens (nostalgebraist, 2020): decode any residual vector with the model's own final norm and unembedding.

Stream `l` (0..n_layers) is the residual stream after `l` blocks. Beyond the block boundaries,
`LogitLens.decode` also reads the middle of a block (`resid_mid`) and what each sublayer writes
(`attn_out`, `mlp_out`): the final norm is then recomputed on that write alone, so the logits say
which tokens the write by itself pushes up.
"""

from __future__ import annotations

from typing import Iterator

import torch

from lenskit import ActivationCache, HookedTransformer
from lenskit.cache import hook_name

from .base import Lens

# Points of a block that can be read through a lens; `layer` indexes blocks 0..n_layers-1,
# except that ("resid_pre", n_layers) means the last block's output, so that stream l == resid_pre l.
POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")


def resid_hook_name(point: str, layer: int, n_layers: int) -> str:
    """Hook name of a residual point; ("resid_pre", n_layers) is the final stream.

    >>> resid_hook_name("resid_pre", 6, n_layers=6)
    'blocks.5.hook_resid_post'
    """
    if point not in POINTS:
        raise KeyError(f"unknown residual point {point!r}; expected one of {POINTS}")
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    top = n_layers if point == "resid_pre" else n_layers - 1
    if not 0 <= layer <= top:
        raise IndexError(f"{point} layer {layer} is out of range: expected 0..{top} for a model with {n_layers} blocks")
    if point == "resid_pre" and layer == n_layers:
        return hook_name("resid_post", n_layers - 1)
    return hook_name(point, layer)


def point_names(point: str, n_layers: int) -> list[str]:
    """Hook names of every layer of a point, in order (n_layers + 1 of them for resid_pre, else n_layers)."""
    top = n_layers if point == "resid_pre" else n_layers - 1
    return [resid_hook_name(point, layer, n_layers) for layer in range(top + 1)]


def streams(cache: ActivationCache, point: str = "resid_pre") -> Iterator[tuple[int, torch.Tensor]]:
    """(layer, h [batch, pos, d_model]) for every layer of `point`; resid_pre yields streams 0..n_layers."""
    for layer, name in enumerate(point_names(point, cache.n_layers)):
        yield layer, cache[name]


class LogitLens(Lens):
    """`unembed(ln_final(h))` for the stream after any number of blocks, with no trained parameters.

    The final norm's scale is recomputed on every `h` it reads. (Reusing the last layer's cached
    scale, a bug TransformerLens once shipped, mis-scales every earlier layer.)

    >>> lens = LogitLens(model)
    >>> logits, cache = model.run_with_cache(tokens)
    >>> lens(cache["resid_pre", 2], 2)                           # stream after 2 blocks: [batch, pos, d_vocab]
    >>> lens.decode(cache, layer=2, point="mlp_out")             # what block 2's MLP writes, read alone
    """

    name = "logit"

    def __init__(self, model: HookedTransformer) -> None:
        super().__init__(model)

    def transform_hidden(self, h: torch.Tensor, l: int) -> torch.Tensor:
        return h  # the logit lens reads every stream as if it were the last one

    def decode(self, cache: ActivationCache, layer: int, point: str = "resid_pre") -> torch.Tensor:
        """Logits [batch, pos, d_vocab] of one residual point (see `POINTS`) from a cache."""
        h = cache[resid_hook_name(point, layer, self.n_layers)]
        return self.unembed(h)

    def decode_all(self, cache: ActivationCache, point: str = "resid_pre") -> Iterator[tuple[int, torch.Tensor]]:
        """(layer, logits [batch, pos, d_vocab]) one layer at a time, so only one layer's logits are alive."""
        for layer, h in streams(cache, point):
            yield layer, self.unembed(h)

"""The lens interface: a lens maps the residual stream after `l` blocks to logits."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from lenskit import HookedTransformer


class Lens(nn.Module, ABC):
    """`lens(h, l) -> logits`: decode stream `l` (0..n_layers; l = n_layers is the model's own output).

    A subclass says only how it moves `h` into the final layer's basis (`transform_hidden`); decoding
    is always the model's own final norm, recomputed on the transformed stream, then the unembedding.
    """

    def __init__(self, model: HookedTransformer) -> None:
        super().__init__()
        # Stored outside the module tree so that lens state dicts and .parameters() hold the lens alone.
        object.__setattr__(self, "model", model)

    @property
    def n_layers(self) -> int:
        return self.model.cfg.n_layers

    def check_layer(self, l: int) -> int:
        if not isinstance(l, int) or isinstance(l, bool) or not 0 <= l <= self.n_layers:
            raise IndexError(f"stream index {l!r} is out of range: expected 0..{self.n_layers} (streams after 0..n_layers blocks)")
        return l

    @abstractmethod
    def transform_hidden(self, h: torch.Tensor, l: int) -> torch.Tensor:
        """h [..., d_model] at stream l -> h' [..., d_model] in the last stream's basis."""

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d_model] -> [..., d_vocab]: final norm (its scale computed on this h) then unembedding."""
        return self.model.readout(h)

    def forward(self, h: torch.Tensor, l: int) -> torch.Tensor:
        if h.shape[-1] != self.model.cfg.d_model:
            raise ValueError(f"expected a stream with d_model={self.model.cfg.d_model} in the last axis, got shape {tuple(h.shape)}")
        return self.unembed(self.transform_hidden(h, self.check_layer(l)))

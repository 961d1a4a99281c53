"""The lens interface: a lens maps a place in the residual stream (a `lenskit.Stream`, or a bare int l: the
stream after l blocks) to logits."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from lenskit import ActivationCache, HookedTransformer, Stream
from lenskit.stream import as_stream


class Lens(nn.Module, ABC):
    """`lens(h, s) -> logits`: decode the stream at `s`, a `Stream` or an int l for `Stream(l)`, the stream
    after l blocks (0..n_layers; l = n_layers is the model's own output; negative l counts back from n_layers).

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

    def stream(self, s: int | str | Stream) -> Stream:
        """`s` as a Stream checked against the model, with a non-negative layer."""
        return as_stream(s).resolve(self.n_layers)

    @abstractmethod
    def transform_hidden(self, h: torch.Tensor, s: Stream) -> torch.Tensor:
        """h [..., d_model] at the (resolved) stream s -> h' [..., d_model] in the last stream's basis."""

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d_model] -> [..., d_vocab]: final norm (its scale computed on this h) then unembedding, in the
        model's dtype; half-precision logits come out upcast to float32, for the metrics' log-softmax."""
        dtype = self.model.unembed.weight.dtype
        logits = self.model.readout(h if h.dtype == dtype else h.to(dtype))
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

    def forward(self, h: torch.Tensor, s: int | str | Stream) -> torch.Tensor:
        """h [..., d_model] at stream s -> logits [..., d_vocab]."""
        if h.shape[-1] != self.model.cfg.d_model:
            raise ValueError(f"expected a stream with d_model={self.model.cfg.d_model} in the last axis, got shape {tuple(h.shape)}")
        return self.unembed(self.transform_hidden(h, self.stream(s)))

    def decode(self, cache: ActivationCache, s: int | str | Stream, point: str | None = None) -> torch.Tensor:
        """Logits [batch, pos, d_vocab] of the stream at `s` read from a cache (`point` names the point of a bare layer)."""
        s = as_stream(s, point)
        return self(cache.stream(s), s)

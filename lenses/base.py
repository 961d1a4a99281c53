"""The lens interface: a lens maps a place in the residual stream (a `lenskit.Stream`, or a bare int l: the
stream after l blocks) to logits.

Two kinds, told apart by their class, never by which methods a subclass overrides:

- `BasisLens`: moves `h` within the model's basis (`transform_hidden`), then decodes it with the model's
  own `Readout` (final norm recomputed on the moved stream, unembedding, any soft-cap). The logit lens,
  the tuned lens and the Jacobian lens are of this kind.
- any other `Lens`: computes logits its own way (`forward`), for example by running the model again.

Evaluation, trajectories and plots take either: they ask the lens for logits (`lens(h, s)`, or
`lens.logits_into(rows, s, out)` into a reused buffer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from lenskit import ActivationCache, HookedTransformer, Stream
from lenskit.observe.stream import as_stream


class Lens(nn.Module, ABC):
    """`lens(h, s) -> logits`: decode the stream at `s`, a `Stream` or an int l for `Stream(l)`, the stream
    after l blocks (0..n_layers; l = n_layers is the model's own output; negative l counts back from n_layers).
    Logits come out in float32 (upcast from a half-precision model) for the metrics.
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

    def check_hidden(self, h: torch.Tensor) -> None:
        if h.shape[-1] != self.model.cfg.d_model:
            raise ValueError(f"expected a stream with d_model={self.model.cfg.d_model} in the last axis, got shape {tuple(h.shape)}")

    @abstractmethod
    def forward(self, h: torch.Tensor, s: int | str | Stream) -> torch.Tensor:
        """h [..., d_model] at stream s -> logits [..., d_vocab] (float32)."""

    def logits_into(self, h: torch.Tensor, s: Stream, out: torch.Tensor) -> torch.Tensor:
        """Rows h [rows, d_model] at the (resolved) stream s -> their logits written into the float32 buffer
        out [rows, d_vocab]. Evaluation calls this; a lens may write straight into `out`."""
        return out.copy_(self(h, s))

    def covers(self, s: Stream) -> bool:
        """Whether this lens decodes the (resolved) stream s. A lens fitted for some streams only (a Jacobian lens
        imported from a reference file has no matrix for the embeddings) says False elsewhere, and evaluation and
        trajectories leave those cells empty (NaN) instead of failing; calling the lens there raises."""
        return True

    def reads_as_model(self, s: Stream) -> bool:
        """Whether this lens's logits at stream s are the model's own readout of the stream (the logit lens at
        every stream, a tuned lens at the last). Evaluation reuses the model's numbers there; False is always safe."""
        return False

    def decode(self, cache: ActivationCache, s: int | str | Stream, point: str | None = None) -> torch.Tensor:
        """Logits [batch, pos, d_vocab] of the stream at `s` read from a cache (`point` names the point of a bare layer)."""
        s = as_stream(s, point)
        return self(cache.stream(s), s)


class BasisLens(Lens):
    """A lens that moves `h` into the last stream's basis and decodes it with the model's `Readout`.

    A subclass writes only `transform_hidden(h, s)`; the logit lens is the identity.
    """

    @abstractmethod
    def transform_hidden(self, h: torch.Tensor, s: Stream) -> torch.Tensor:
        """h [..., d_model] at the (resolved) stream s -> h' [..., d_model] in the last stream's basis."""

    def forward(self, h: torch.Tensor, s: int | str | Stream) -> torch.Tensor:
        self.check_hidden(h)
        return self.model.readout.logits(self.transform_hidden(h, self.stream(s)))

    def logits_into(self, h: torch.Tensor, s: Stream, out: torch.Tensor) -> torch.Tensor:
        self.check_hidden(h)
        return self.model.readout.into(self.transform_hidden(h, s), out)

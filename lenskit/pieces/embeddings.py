"""The model's embedding, position table and unembedding as modules that carry TransformerLens's per-module weight
names (`model.embed.W_E`, `model.pos_embed.W_pos`, `model.unembed.W_U`, `model.unembed.b_U`). Their parameters and
state-dict names are those of the torch modules they extend; the names are views."""

from __future__ import annotations

import torch
from torch import nn

from .linear import Linear, written


class Embed(nn.Embedding):
    """Token embedding; `W_E` [d_vocab, d_model] is the parameter itself."""

    @property
    def W_E(self) -> torch.Tensor:
        return self.weight


class PosEmbed(nn.Embedding):
    """Learned position table; `W_pos` [n_ctx, d_model] is the parameter itself."""

    @property
    def W_pos(self) -> torch.Tensor:
        return self.weight


class Unembed(Linear):
    """The unembedding [d_vocab, d_model] as stored; `W_U` [d_model, d_vocab] is its transposed view, and `b_U`
    [d_vocab] its bias, zeros where there is none (only `fold_ln` of a LayerNorm gives it one). Its output is the
    logits: times `scale` where the family scales them (`cfg.scales.logits`, Granite's 1 / logits_scaling), and
    `W_U`, `b_U` include it then (copies)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, scale: float = 1.0) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.scale == 1.0 else out * self.scale

    @property
    def W_U(self) -> torch.Tensor:
        return written(self, self.weight.T)

    @property
    def b_U(self) -> torch.Tensor:
        return self.weight.new_zeros(self.weight.shape[0]) if self.bias is None else written(self, self.bias)

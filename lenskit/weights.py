"""TransformerLens's weight views on `HookedTransformer`: `W_E`, `W_U`, `W_Q` ... stacked over layers.

Shapes follow TransformerLens: `W_Q`, `W_K`, `W_V` [layer, head, d_model, d_head], `W_O` [layer, head,
d_head, d_model], `W_in` / `W_gate` [layer, d_model, d_mlp], `W_out` [layer, d_mlp, d_model], `W_E`
[d_vocab, d_model], `W_pos` [n_ctx, d_model], `W_U` [d_model, d_vocab]. The per-layer views are stacked
copies: read them, and edit weights through the modules (`model.blocks[l].attn.out.weight` ...).

Under grouped-query attention `W_K`, `W_V` (and `b_K`, `b_V`) have one entry per query head, query head
h reading kv head h // (n_heads // n_kv_heads), as TransformerLens's `HookedTransformer` shows them, so
`W_Q[l, h] @ W_K[l, h].T` is head h's QK circuit. The kv heads themselves are `W_K[:, ::group]`.

A bias the model lacks (Llama has no q/k/v bias; no family has an unembedding bias) reads as zeros, as in
TransformerLens, so `x @ W_U + b_U` and `x @ W_Q + b_Q` hold for every family. `W_gate` is None for an
ungated MLP; `W_pos` exists only for learned positions. Nothing is folded: these are the raw weights
(see README, "Coming from TransformerLens").
"""

from __future__ import annotations

import torch
from torch import nn


def _qkv(attn: nn.Module, which: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One of q/k/v's (weight [out, d_model], bias [out] or None), from a fused or split projection."""
    qkv = attn.qkv
    if hasattr(qkv, "sizes"):  # fused: rows are [q heads | k heads | v heads]
        i = "qkv".index(which)
        weight = qkv.weight.split(qkv.sizes, dim=0)[i]
        return weight, None if qkv.bias is None else qkv.bias.split(qkv.sizes)[i]
    linear = getattr(qkv, which)
    return linear.weight, linear.bias


class WeightViews:
    """Mixin for `HookedTransformer`: TransformerLens's named weight tensors, read from the modules."""

    cfg: object
    blocks: nn.ModuleList

    # ------------------------------------------------------------ embeddings
    @property
    def W_E(self) -> torch.Tensor:
        """Token embedding [d_vocab, d_model] (the parameter itself)."""
        return self.embed.weight

    @property
    def W_pos(self) -> torch.Tensor:
        """Learned position embedding [n_ctx, d_model]; rotary families have none."""
        return self.pos_embed.weight  # an AttributeError for rotary families, which have no pos_embed

    @property
    def W_U(self) -> torch.Tensor:
        """Unembedding [d_model, d_vocab] (a transposed view of the parameter)."""
        return self.unembed.weight.T

    @property
    def b_U(self) -> torch.Tensor:
        """Unembedding bias [d_vocab]: zeros, since no supported family has one."""
        return self.unembed.weight.new_zeros(self.cfg.d_vocab)

    # ------------------------------------------------------------- attention
    def _per_head(self, which: str, bias: bool) -> torch.Tensor:
        """q/k/v weights [layer, head, d_model, d_head] or biases [layer, head, d_head], kv heads repeated."""
        c = self.cfg
        out = []
        for block in self.blocks:
            weight, b = _qkv(block.attn, which)
            if bias:
                t = (weight.new_zeros(weight.shape[0]) if b is None else b).view(-1, c.d_head)  # [head | kv_head, d_head]
            else:
                t = weight.view(-1, c.d_head, c.d_model).transpose(1, 2)  # [head | kv_head, d_model, d_head]
            out.append(t.repeat_interleave(c.n_heads // t.shape[0], dim=0))  # query head h reads kv head h // group
        return torch.stack(out)

    @property
    def W_Q(self) -> torch.Tensor:
        return self._per_head("q", bias=False)

    @property
    def W_K(self) -> torch.Tensor:
        return self._per_head("k", bias=False)

    @property
    def W_V(self) -> torch.Tensor:
        return self._per_head("v", bias=False)

    @property
    def b_Q(self) -> torch.Tensor:
        return self._per_head("q", bias=True)

    @property
    def b_K(self) -> torch.Tensor:
        return self._per_head("k", bias=True)

    @property
    def b_V(self) -> torch.Tensor:
        return self._per_head("v", bias=True)

    @property
    def W_O(self) -> torch.Tensor:
        """[layer, head, d_head, d_model]: head h's slice of the output projection."""
        c = self.cfg
        return torch.stack([b.attn.out.weight.T.reshape(c.n_heads, c.d_head, c.d_model) for b in self.blocks])

    @property
    def b_O(self) -> torch.Tensor:
        return self._stacked("attn", "out", bias=True)

    # ------------------------------------------------------------------- MLP
    def _stacked(self, part: str, name: str, bias: bool) -> torch.Tensor:
        """A linear map's weight [layer, d_in, d_out] (transposed to TransformerLens's x @ W) or bias [layer, d_out]."""
        linears = [getattr(getattr(block, part), name) for block in self.blocks]
        if bias:
            return torch.stack([lin.weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias for lin in linears])
        return torch.stack([lin.weight.T for lin in linears])

    @property
    def W_in(self) -> torch.Tensor:
        """[layer, d_model, d_mlp]; for a gated MLP, the linear (ungated) input, as in TransformerLens."""
        return self._stacked("mlp", "fc_in", bias=False)

    @property
    def W_gate(self) -> torch.Tensor | None:
        """[layer, d_model, d_mlp]: the gate of a gated MLP (SwiGLU); None for a GELU MLP."""
        return self._stacked("mlp", "gate", bias=False) if hasattr(self.blocks[0].mlp, "gate") else None

    @property
    def W_out(self) -> torch.Tensor:
        return self._stacked("mlp", "fc_out", bias=False)

    @property
    def b_in(self) -> torch.Tensor:
        return self._stacked("mlp", "fc_in", bias=True)

    @property
    def b_out(self) -> torch.Tensor:
        return self._stacked("mlp", "fc_out", bias=True)

"""TransformerLens's weight views, which `HookedTransformer` declares: `W_E`, `W_U`, `W_Q` ... stacked over layers.

Shapes follow TransformerLens: `W_Q`, `W_K`, `W_V` [layer, head, d_model, d_head], `W_O` [layer, head,
d_head, d_model], `W_in` / `W_gate` [layer, d_model, d_mlp], `W_out` [layer, d_mlp, d_model], `W_E`
[d_vocab, d_model], `W_pos` [n_ctx, d_model], `W_U` [d_model, d_vocab]. Each block's pieces own their
views (`model.blocks[l].attn.W_Q`, `model.blocks[l].mlp.W_in`, in `lenskit.pieces.attention.Attention` and
`lenskit.pieces.layers.MLP`, which know whether their projections are fused); here they are only stacked. The
stacks are copies: read them, and edit weights through the modules (`model.blocks[l].attn.out.weight` ...).

Under grouped-query attention `W_K`, `W_V` (and `b_K`, `b_V`) have one entry per query head, query head
h reading kv head h // (n_heads // n_kv_heads), as TransformerLens's `HookedTransformer` shows them, so
`W_Q[l, h] @ W_K[l, h].T` is head h's QK circuit. The kv heads themselves are `W_K[:, ::group]`.

A bias the model lacks (Llama has no q/k/v bias; no family has an unembedding bias) reads as zeros, as in
TransformerLens, so `x @ W_U + b_U` and `x @ W_Q + b_Q` hold for every family. `W_gate` is None for an
ungated MLP, and `b_gate` (the gate's bias, which TransformerLens lacks) with it; `W_pos` exists only
for learned positions. In a mixture of experts the MLP views are per expert (`lenskit.pieces.moe.MoE`):
`W_in` / `W_gate` [layer, expert, d_model, d_expert], `W_out` [layer, expert, d_expert, d_model]; a model
that mixes MoE and dense blocks refuses to stack them (read them per block). Nothing is folded: these are the raw weights
(see docs/howto/transformer_lens.md, "Coming from TransformerLens").

`OV` and `QK` are each head's circuits as `FactoredMatrix` [layer, head, d_model, d_model] (`W_V @ W_O`,
`W_Q @ W_K^T`); `tl_parameters()` names every view as TransformerLens's `HookedTransformer` names its parameters
(`blocks.0.attn.W_Q`, `blocks.0.ln1.w`, `unembed.W_U` ...).
"""

from __future__ import annotations

import torch
from torch import nn

from ..factored import FactoredMatrix


def stacked_view(part: str, name: str, doc: str) -> property:
    """A view that each block's `part` (attn or mlp) owns, stacked over layers; None where the blocks have None."""

    def get(self) -> torch.Tensor | None:
        without = [l for l, block in enumerate(self.blocks) if not hasattr(type(getattr(block, part)), name)]
        if without:  # Qwen 3.5's linear-attention blocks have no heads' weights
            kind = getattr(getattr(self.blocks[without[0]], part), "LAYER_TYPE", type(getattr(self.blocks[without[0]], part)).__name__)
            raise ValueError(f"model.{name} cannot stack the blocks' {part}.{name}: blocks {without} are {kind} layers, "
                             f"which have none; read model.blocks[l].{part}.{name} of the other blocks")
        views = [getattr(getattr(block, part), name) for block in self.blocks]
        if views[0] is None:
            return None
        shapes = {None if v is None else tuple(v.shape) for v in views}
        if len(shapes) > 1:  # a mixture of experts with dense blocks (Qwen3-MoE's mlp_only_layers)
            raise ValueError(f"model.{name} cannot stack the blocks' {part}.{name}: their shapes differ ({sorted(map(str, shapes))}); "
                             f"read model.blocks[l].{part}.{name} block by block")
        return torch.stack(views)

    return property(get, doc=doc)


def ov_circuit(views) -> FactoredMatrix:
    """W_V @ W_O of whatever holds TransformerLens's views (a block's attention, or the model stacked over layers),
    [..., head, d_model, d_model], kept factored; kv heads repeated under GQA."""
    return FactoredMatrix(views.W_V, views.W_O)


def qk_circuit(views) -> FactoredMatrix:
    """W_Q @ W_K^T [..., head, d_model, d_model], kept factored: the bilinear form of each head's attention scores."""
    return FactoredMatrix(views.W_Q, views.W_K.transpose(-2, -1))


class HeadCircuits:
    """Mixin for an attention piece with TransformerLens's views `W_Q`, `W_K`, `W_V` [head, d_model, d_head] and
    `W_O` [head, d_head, d_model]: each head's circuits, `model.blocks[l].attn.OV` and `.QK`."""

    OV = property(lambda self: ov_circuit(self), doc="[head, d_model, d_model]: each head's OV circuit, factored")
    QK = property(lambda self: qk_circuit(self), doc="[head, d_model, d_model]: each head's QK circuit, factored")


def tl_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weight views under the names TransformerLens's `HookedTransformer` gives its parameters, e.g.
    `blocks.0.attn.W_Q` [head, d_model, d_head], `blocks.0.ln1.w` [d_model], `unembed.W_U` [d_model, d_vocab].

    Norm gains are `w` (for Gemma's (1 + w) norms, the whole multiplier) and LayerNorm biases `b`; a block's
    pieces without a view (a linear-attention block's heads) are left out, as are absent gates."""
    out = {"embed.W_E": model.W_E}
    if hasattr(model, "pos_embed"):
        out["pos_embed.W_pos"] = model.W_pos
    for l, block in enumerate(model.blocks):
        for part, names in (("attn", ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")),
                            ("mlp", ("W_in", "W_gate", "W_out", "b_in", "b_gate", "b_out"))):
            piece = getattr(block, part)
            for name in names:
                view = getattr(piece, name, None) if hasattr(type(piece), name) else None
                if view is not None:
                    out[f"blocks.{l}.{part}.{name}"] = view
        for norm in ("ln1", "ln2"):
            if hasattr(block, norm):
                out.update(_norm_views(f"blocks.{l}.{norm}", getattr(block, norm)))
    out.update(_norm_views("ln_final", model.ln_final))
    out["unembed.W_U"], out["unembed.b_U"] = model.W_U, model.b_U
    return out


def _norm_views(prefix: str, norm: nn.Module) -> dict[str, torch.Tensor]:
    """A norm's gain as `prefix.w` and any bias as `prefix.b`; nothing for a norm without a gain."""
    views = {f"{prefix}.w": norm.gain} if hasattr(norm, "gain") else {}
    if getattr(norm, "bias", None) is not None:
        views[f"{prefix}.b"] = norm.bias
    return views

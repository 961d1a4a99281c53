"""`transformer_lens.components`: TransformerLens's component class names, for `isinstance` checks in code written
for it. lenskit builds its own pieces (lenskit.pieces); each name here is an abstract class that lenskit's matching
pieces count as instances of, so `isinstance(model.blocks[0].attn, components.Attention)` holds.

A name is for checking, not building: calling one refuses, since lenskit builds a model from its config.

>>> from lenskit.transformer_lens import components
>>> isinstance(model.blocks[0].mlp, components.MLP), isinstance(model.blocks[0].mlp, components.GatedMLP)
(True, False)
"""

from __future__ import annotations

import abc
from typing import Any, Callable

from lenskit.pieces.attention import Attention as _Attention
from lenskit.pieces.embeddings import Embed as _Embed
from lenskit.pieces.embeddings import PosEmbed as _PosEmbed
from lenskit.pieces.embeddings import Unembed as _Unembed
from lenskit.pieces.layers import GeluMLP as _GeluMLP
from lenskit.pieces.layers import SwiGLU as _SwiGLU
from lenskit.pieces.layers import TransformerBlock as _TransformerBlock
from lenskit.pieces.moe import MoE as _MoE
from lenskit.pieces.norms import LayerNorm as _LayerNorm
from lenskit.pieces.norms import RMSNorm as _RMSNorm

from .mlps.can_be_used_as_mlp import CanBeUsedAsMLP, Role


def _role(name: str, pieces: tuple[type, ...], when: Callable[[Any], bool] | None = None,
          doc: str = "") -> type:
    """An abstract class whose instances are lenskit's `pieces` (those for which `when` holds, if given)."""
    return Role(name, (abc.ABC,), {"__doc__": doc, "_pieces": pieces, "_when": staticmethod(when) if when else None,
                                   "__module__": __name__})


AbstractAttention = _role("AbstractAttention", (_Attention,), doc="Any softmax attention.")
Attention = _role("Attention", (_Attention,), lambda a: a.group == 1, "Attention where every head has its own keys.")
GroupedQueryAttention = _role("GroupedQueryAttention", (_Attention,), lambda a: a.group > 1,
                              "Attention whose query heads share key/value heads.")
MLP = _role("MLP", (_GeluMLP,), doc="An ungated MLP.")
GatedMLP = _role("GatedMLP", (_SwiGLU,), doc="A gated MLP (SwiGLU, GeGLU).")
MoE = _role("MoE", (_MoE,), doc="A mixture of experts.")
LayerNorm = _role("LayerNorm", (_LayerNorm,), doc="LayerNorm.")
RMSNorm = _role("RMSNorm", (_RMSNorm,), doc="RMSNorm (Gemma's 1 + w too).")
Embed = _role("Embed", (_Embed,), doc="The token embedding.")
PosEmbed = _role("PosEmbed", (_PosEmbed,), doc="The learned position table.")
Unembed = _role("Unembed", (_Unembed,), doc="The unembedding.")
TransformerBlock = _role("TransformerBlock", (_TransformerBlock,), doc="A block, in any of lenskit's forms.")

__all__ = ["AbstractAttention", "Attention", "CanBeUsedAsMLP", "Embed", "GatedMLP", "GroupedQueryAttention",
           "LayerNorm", "MLP", "MoE", "PosEmbed", "RMSNorm", "TransformerBlock", "Unembed"]

"""Gemma 4's per-layer inputs (E2B, E4B): each block gets a small input of its own, made from the tokens before the
first block, and writes a gated projection of it to the stream after its MLP.

Before the blocks (`PerLayerInputs`, the model's `per_layer_inputs`), for every block at once:

    token  = embed_per_layer(tokens) * sqrt(d_per_layer)                  [batch, pos, layer, d_per_layer]
    proj   = norm(proj(embed) * d_model ** -0.5)                         [batch, pos, layer, d_per_layer]
    inputs = (proj + token) * 2 ** -0.5                                  [batch, pos, layer, d_per_layer]

where `embed` is the scaled token embedding (`hook_embed`), the block's first input. Inside block L, after its MLP's
write (`PerLayerWrite`, the block's `per_layer`), with x the stream there (resid_mid + mlp_out):

    per_layer_out = ln_post(out(act(gate(x)) * inputs[:, :, L]))        [batch, pos, d_model]

one more write to the stream, added before the block's `layer_scalar` rescaling. Hooks: `per_layer_inputs.hook_token`
and `.hook_proj` [batch, pos, layer, d_per_layer], the block's `hook_per_layer_in` [batch, pos, d_per_layer] (its
slice of `inputs`: edit it to change what one block reads) and `hook_per_layer_out` [batch, pos, d_model] (the write,
a term of `decompose_resid`), and inside `per_layer`, `hook_pre` (the gate's pre-activation) and `hook_post`
(act(gate) * input), both [batch, pos, d_per_layer]. Names follow transformers' `Gemma4TextModel`:
`embed_tokens_per_layer`, `per_layer_model_projection`, `per_layer_projection_norm`, and in each layer
`per_layer_input_gate`, `per_layer_projection`, `post_per_layer_input_norm` (lenskit.families.gemma4_text).

The inputs reach the blocks in the forward's state (lenskit.pieces.forward_state), the argument each block is run
with (`block(x, state)`), and each block takes its own slice there.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .linear import Linear
from .norms import make_norm, norm_params


class PerLayerInputs(nn.Module):
    """Every block's per-layer input, from the tokens and the scaled token embedding (see the module docstring)."""

    @classmethod
    def params(cls, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row (lenskit.accounting), as (weights, biases): the table (an embedding,
        d_vocab_per_layer x n_layers x d_per_layer) under `per_layer_embed`; the projection of the token embedding
        to the inputs, and its norm's gain, under `per_layer_proj`."""
        width = cfg.n_layers * cfg.block.d_per_layer
        return {"per_layer_embed": (cfg.block.d_vocab_per_layer * width, 0),
                "per_layer_proj": (cfg.d_model * width + cfg.block.d_per_layer, 0)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_layers, self.d_per_layer, self.d_model = cfg.n_layers, cfg.block.d_per_layer, cfg.d_model
        width = cfg.n_layers * cfg.block.d_per_layer  # every block's input side by side, as the checkpoint packs them
        self.embed = nn.Embedding(cfg.block.d_vocab_per_layer, width)
        self.proj = Linear(cfg.d_model, width, bias=False)
        self.proj_norm = make_norm(cfg, cfg.block.d_per_layer)
        self.hook_token = HookPoint()  # [batch, pos, layer, d_per_layer]
        self.hook_proj = HookPoint()  # [batch, pos, layer, d_per_layer]

    def forward(self, tokens: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """tokens [batch, pos], embed [batch, pos, d_model] -> inputs [batch, pos, layer, d_per_layer]."""
        shape = (*tokens.shape, self.n_layers, self.d_per_layer)
        table = self.embed.weight
        scale = torch.tensor(self.d_per_layer ** 0.5).to(device=table.device, dtype=table.dtype)  # rounded as Gemma's
        token = self.hook_token((self.embed(tokens.to(table.device)) * scale).view(shape))
        embed = embed.to(table.device)
        proj = self.hook_proj(self.proj_norm((self.proj(embed) * self.d_model ** -0.5).view(shape)))
        return (proj + token) * 2 ** -0.5


class PerLayerWrite(nn.Module):
    """A block's write from its per-layer input: ln_post(out(act(gate(x)) * input)), x the stream after the MLP."""

    @classmethod
    def params(cls, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row (lenskit.accounting), as (weights, biases): the gate and projection of the
        block's per-layer input under `per_layer`, its norm under `norms`."""
        return {"per_layer": (2 * cfg.d_model * cfg.block.d_per_layer, 0), "norms": norm_params(cfg)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = partial(F.gelu, approximate=cfg.gelu_approximate)
        self.gate = Linear(cfg.d_model, cfg.block.d_per_layer, bias=False)
        self.out = Linear(cfg.block.d_per_layer, cfg.d_model, bias=False)
        self.ln_post = make_norm(cfg)
        self.hook_pre = HookPoint()  # [batch, pos, d_per_layer]
        self.hook_post = HookPoint()  # [batch, pos, d_per_layer]

    def forward(self, x: torch.Tensor, per_layer_in: torch.Tensor) -> torch.Tensor:
        """x [batch, pos, d_model], per_layer_in [batch, pos, d_per_layer] -> the write [batch, pos, d_model]."""
        post = self.hook_post(self.act(self.hook_pre(self.gate(x))) * per_layer_in)
        return self.ln_post(self.out(post))


def side_inputs(model: nn.Module, cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """What the model's forward computes before its blocks for them to read beside the stream, chosen once from
    `cfg`: `side_inputs(tokens, embed)` -> the per-layer inputs [batch, pos, layer, d_per_layer], or None where the
    model has none (its `ForwardState.per_layer`)."""
    return model.per_layer_inputs.__call__ if cfg.block.d_per_layer is not None else _none


def _none(tokens: torch.Tensor, embed: torch.Tensor) -> None:
    return None

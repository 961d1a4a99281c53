"""TransformerLens's small model conveniences, as free functions of a `HookedTransformer` whose methods of the
same names call them: where a token is in a prompt, the stream direction each token's logit reads, the biases the
blocks add to the stream, and head labels.

>>> model.get_token_position(" x", "x = 1\\ny = x + 1", prepend_bos=False)
6
>>> answer_tokens = torch.tensor([[model.to_single_token(" self"), model.to_single_token(" cls")]])
>>> model.tokens_to_residual_directions(answer_tokens).shape   # answer_tokens [batch, 2] -> [batch, 2, d_model]
torch.Size([1, 2, 192])
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import torch

from .io.text import check_vocabulary
from .observe.names import head_label

if TYPE_CHECKING:
    from torch import nn

    from .model import HookedTransformer


def get_token_position(model: "HookedTransformer", single_token: str | int | torch.Tensor, input: str | torch.Tensor,
                       mode: str = "first", prepend_bos: bool | None = None, padding_side: str | None = None) -> int:
    """The position of `single_token` (text of exactly one token, or an id) in `input`: text (tokenized as
    `model.to_tokens(input, prepend_bos, padding_side)` does) or ids [pos] or [1, pos]. `mode` "first" or "last"
    picks among several occurrences; a token that does not occur is a ValueError.

    >>> model.get_token_position("x", "x = 1\\nx = x + 1", mode="last")
    4
    """
    if mode not in ("first", "last"):
        raise ValueError(f"mode must be 'first' or 'last', got {mode!r}")
    tokens = model.to_tokens(input, prepend_bos, padding_side) if isinstance(input, str) else torch.as_tensor(input)
    if tokens.ndim == 2 and tokens.shape[0] == 1:
        tokens = tokens[0]
    if tokens.ndim != 1:
        raise ValueError(f"input must be text or token ids [pos] or [1, pos], got shape {tuple(tokens.shape)}")
    token = _one_token_id(model, single_token)
    where = (tokens == token).nonzero()[:, 0]
    if len(where) == 0:
        raise ValueError(f"token {token} ({model.to_single_str_token(token)!r}) does not occur in the input")
    return int(where[0] if mode == "first" else where[-1])


def tokens_to_residual_directions(model: "HookedTransformer", tokens: str | int | torch.Tensor) -> torch.Tensor:
    """The unembedding column of each token, `W_U[:, token]`: the stream direction whose dot product is that
    token's logit (before the final norm). A single token (text of one token, an id, or a one-element
    tensor) gives [d_model]; ids of shape [...] with more than one element give [..., d_model].

    Read it on a model loaded with `fold_ln=True`: otherwise the final norm's weights, which the
    unembedding does not include, also scale each direction.
    """
    if isinstance(tokens, torch.Tensor) and tokens.numel() > 1:
        ids = check_vocabulary(tokens, model.cfg.d_vocab).to(model.W_U.device)
        return model.W_U[:, ids].movedim(0, -1)  # [..., d_model]
    return model.W_U[:, _one_token_id(model, tokens)]  # [d_model]


def accumulated_bias(model: "HookedTransformer", layer: int, mlp_input: bool = False,
                     include_mlp_biases: bool = True) -> torch.Tensor:
    """The sum [d_model] of the output biases (`attn.b_O`, and with `include_mlp_biases` `mlp.b_out`) that
    blocks 0 .. layer - 1 add to the stream: the constant part of resid_pre of block `layer` (0 <= layer <=
    n_layers). With `mlp_input`, block `layer`'s own `attn.b_O` too (the constant part of its resid_mid).

    A bias that a post-norm (Gemma, OLMo 2) or a router (a mixture of experts) changes before it reaches
    the stream is not a constant write; such a nonzero bias is refused.
    """
    n = model.cfg.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
        raise ValueError(f"layer must be an int in [0, {n}] (the input of block `layer`), got {layer!r}")
    if mlp_input and layer == n:
        raise ValueError(f"mlp_input=True needs a block's MLP input, so layer < n_layers={n}; got layer={layer}")
    total = model.W_E.new_zeros(model.cfg.d_model)  # [d_model]
    writes = [(l, "attn", "b_O") for l in range(layer)]
    writes += [(l, "mlp", "b_out") for l in range(layer)] if include_mlp_biases else []
    writes += [(layer, "attn", "b_O")] if mlp_input else []
    for l, part, name in writes:
        bias = _constant_write(model.blocks[l], part, name)
        if bias is not None:
            total = total + bias.to(total.device)
    return total


def all_head_labels(n_layers: int, n_heads: int) -> list[str]:
    """"L{layer}H{head}" for every attention head, layer by layer: n_layers * n_heads labels."""
    return [head_label(l, h) for l in range(n_layers) for h in range(n_heads)]


def _one_token_id(model: "HookedTransformer", token: str | int | torch.Tensor) -> int:
    """One token as its id: text of exactly one token, an int, or a one-element integer tensor."""
    if isinstance(token, str):
        return model.to_single_token(token)
    if isinstance(token, torch.Tensor) and token.numel() == 1:
        return int(check_vocabulary(token.reshape(1), model.cfg.d_vocab)[0])
    if isinstance(token, numbers.Integral) and not isinstance(token, bool):  # numpy ints too
        return int(check_vocabulary(torch.tensor([int(token)]), model.cfg.d_vocab)[0])
    raise TypeError(f"expected one token (text of one token, an int id or a one-element tensor), got "
                    f"{type(token).__name__} {token!r:.40}")


def _constant_write(block: "nn.Module", part: str, name: str) -> torch.Tensor | None:
    """The bias [d_model] that `block.<part>` adds to the stream whatever its input, or None where it adds none."""
    module = getattr(block, part)
    if not hasattr(type(module), name):
        return None  # a mixer without the view (Qwen 3.5's linear attention) has an unbiased output projection
    bias = getattr(module, name)
    if bias.ndim == 1 and not block.POST_NORMS:
        return bias
    if bias.any():
        where = "a norm after the sublayer" if block.POST_NORMS else "the router's expert weights"
        raise ValueError(f"{part}.{name} is scaled by {where} before it reaches the stream, so it is not a "
                         "constant write; accumulated_bias covers pre-norm blocks and dense MLPs")
    return None

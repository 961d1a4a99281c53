"""TransformerLens's small model conveniences on `HookedTransformer`: where a token is in a prompt, the
stream direction each token's logit reads, the loss of given logits, the biases the blocks add to the stream,
head labels, and the token-and-position input basis.

>>> model.get_token_position(" cat", "The cat sat on the mat", prepend_bos=False)
1
>>> model.tokens_to_residual_directions(answer_tokens).shape   # answer_tokens [batch, 2] -> [batch, 2, d_model]
"""

from __future__ import annotations

import numbers

from typing import TYPE_CHECKING

import torch

from .losses import next_token_loss
from .observe.names import head_label

if TYPE_CHECKING:
    from torch import nn


class ModelConveniences:
    """Mixin for `HookedTransformer` (which gives it `cfg`, `blocks`, the weight views and the text methods)."""

    cfg: object
    blocks: "nn.ModuleList"

    def get_token_position(self, single_token: str | int | torch.Tensor, input: str | torch.Tensor, mode: str = "first",
                           prepend_bos: bool | None = None, padding_side: str | None = None) -> int:
        """The position of `single_token` (text of exactly one token, or an id) in `input`: text (tokenized as
        `to_tokens(input, prepend_bos, padding_side)` does) or ids [pos] or [1, pos]. `mode` "first" or "last"
        picks among several occurrences; a token that does not occur is a ValueError.

        >>> model.get_token_position(" cat", "The cat sat on the mat. The mat sat on the cat.", mode="last")
        """
        if mode not in ("first", "last"):
            raise ValueError(f"mode must be 'first' or 'last', got {mode!r}")
        tokens = self.to_tokens(input, prepend_bos, padding_side) if isinstance(input, str) else torch.as_tensor(input)
        if tokens.ndim == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.ndim != 1:
            raise ValueError(f"input must be text or token ids [pos] or [1, pos], got shape {tuple(tokens.shape)}")
        token = self._one_token_id(single_token)
        where = (tokens == token).nonzero()[:, 0]
        if len(where) == 0:
            raise ValueError(f"token {token} ({self.to_single_str_token(token)!r}) does not occur in the input")
        return int(where[0] if mode == "first" else where[-1])

    def tokens_to_residual_directions(self, tokens: str | int | torch.Tensor) -> torch.Tensor:
        """The unembedding column of each token, `W_U[:, token]`: the stream direction whose dot product is that
        token's logit (before the final norm). A single token (text of one token, an id, or a one-element
        tensor) gives [d_model]; ids of shape [...] with more than one element give [..., d_model].

        Read it on a model loaded with `fold_ln=True`: otherwise the final norm's weights, which the
        unembedding does not include, also scale each direction.
        """
        if isinstance(tokens, torch.Tensor) and tokens.numel() > 1:
            ids = self._in_vocabulary(tokens).to(self.W_U.device)
            return self.W_U[:, ids].movedim(0, -1)  # [..., d_model]
        return self.W_U[:, self._one_token_id(tokens)]  # [d_model]

    def loss_fn(self, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                per_token: bool = False) -> torch.Tensor:
        """Next-token cross-entropy of logits [batch, pos, d_vocab] against tokens [batch, pos]: a scalar, or
        [batch, pos - 1] with `per_token` (`lenskit.losses.next_token_loss`, which documents `attention_mask`)."""
        return next_token_loss(logits, tokens, attention_mask, per_token)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        """The sum [d_model] of the output biases (`attn.b_O`, and with `include_mlp_biases` `mlp.b_out`) that
        blocks 0 .. layer - 1 add to the stream: the constant part of resid_pre of block `layer` (0 <= layer <=
        n_layers). With `mlp_input`, block `layer`'s own `attn.b_O` too (the constant part of its resid_mid).

        A bias that a post-norm (Gemma, OLMo 2) or a router (a mixture of experts) changes before it reaches
        the stream is not a constant write; such a nonzero bias is refused.
        """
        n = self.cfg.n_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
            raise ValueError(f"layer must be an int in [0, {n}] (the input of block `layer`), got {layer!r}")
        if mlp_input and layer == n:
            raise ValueError(f"mlp_input=True needs a block's MLP input, so layer < n_layers={n}; got layer={layer}")
        total = self.W_E.new_zeros(self.cfg.d_model)  # [d_model]
        writes = [(l, "attn", "b_O") for l in range(layer)]
        writes += [(l, "mlp", "b_out") for l in range(layer)] if include_mlp_biases else []
        writes += [(layer, "attn", "b_O")] if mlp_input else []
        for l, part, name in writes:
            bias = _constant_write(self.blocks[l], part, name)
            if bias is not None:
                total = total + bias.to(total.device)
        return total

    def all_head_labels(self) -> list[str]:
        """"L{layer}H{head}" for every attention head, layer by layer: n_layers * n_heads labels."""
        return [head_label(l, h) for l in range(self.cfg.n_layers) for h in range(self.cfg.n_heads)]

    def to_single_str_token(self, int_token: int) -> str:
        """The text of the token with id `int_token`."""
        if isinstance(int_token, bool) or not isinstance(int_token, int):
            raise TypeError(f"to_single_str_token takes an int token id, got {type(int_token).__name__} {int_token!r:.40}")
        return self.to_str_tokens(torch.tensor([int_token]))[0]

    @property
    def W_E_pos(self) -> torch.Tensor:
        """[W_E; W_pos], [d_vocab + n_ctx, d_model]: every token and every position as one input basis (learned
        positions only; rotary families have no W_pos)."""
        if self.cfg.positional != "learned":  # a ValueError: nn.Module would replace an AttributeError's message
            raise ValueError(f"W_E_pos needs learned positions; {self.cfg.family} models are "
                             f"{self.cfg.positional}, with no W_pos")
        return torch.cat([self.W_E, self.W_pos], dim=0)

    def _one_token_id(self, token: str | int | torch.Tensor) -> int:
        """One token as its id: text of exactly one token, an int, or a one-element integer tensor."""
        if isinstance(token, str):
            return self.to_single_token(token)
        if isinstance(token, torch.Tensor) and token.numel() == 1:
            return int(self._in_vocabulary(token.reshape(1))[0])
        if isinstance(token, numbers.Integral) and not isinstance(token, bool):  # numpy ints too
            return int(self._in_vocabulary(torch.tensor([int(token)]))[0])
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

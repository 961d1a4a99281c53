"""Next-token loss and accuracy: each position's logits scored against the token after it.

One home for the language-model loss: `HookedTransformer.forward(return_type="loss")`, `model.loss_fn` and
`lenskit.transformer_lens.utils.lm_cross_entropy_loss` all call `next_token_loss`.

>>> logits = model(tokens)                             # tokens [1, 13]
>>> loss = next_token_loss(logits, tokens)             # scalar: mean nats over batch and positions
>>> per_token = next_token_loss(logits, tokens, per_token=True)
>>> per_token.shape                                    # [batch, pos - 1]
torch.Size([1, 12])
>>> torch.allclose(per_token.mean(), loss)
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(logits: torch.Tensor, tokens: torch.Tensor) -> None:
    if tokens.ndim != 2 or logits.ndim != 3 or logits.shape[:2] != tokens.shape:
        raise ValueError(f"expected logits [batch, pos, d_vocab] and tokens [batch, pos], got logits "
                         f"{tuple(logits.shape)} and tokens {tuple(tokens.shape)}")
    if tokens.shape[1] < 2:
        raise ValueError("a loss needs at least 2 tokens per sequence (each position predicts the next)")


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    per_token: bool = False) -> torch.Tensor:
    """Cross-entropy (nats, computed in float32) of predicting tokens[:, 1:] from logits[:, :-1].

    logits [batch, pos, d_vocab], tokens [batch, pos]. Without `per_token`, the mean over every prediction: a
    scalar. With it, the loss of each prediction [batch, pos - 1]. `attention_mask` [batch, pos] (1 or True:
    a real token) drops each prediction whose position or next position is masked: such entries are 0 in the
    per-token loss, and the mean is over the rest, as TransformerLens's `lm_cross_entropy_loss` counts them.
    """
    _check(logits, tokens)
    tokens = tokens.to(logits.device)
    predicted, targets = logits[:, :-1].float(), tokens[:, 1:]  # [batch, pos - 1, d_vocab], [batch, pos - 1]
    if attention_mask is None and not per_token:
        return F.cross_entropy(predicted.flatten(0, 1), targets.flatten())
    losses = F.cross_entropy(predicted.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    if attention_mask is not None:
        if attention_mask.shape != tokens.shape:
            raise ValueError(f"attention_mask must have the tokens' shape {tuple(tokens.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        mask = attention_mask.to(logits.device).bool()
        kept = mask[:, :-1] & mask[:, 1:]  # [batch, pos - 1]: both the position and the token it predicts are real
        losses = losses.masked_fill(~kept, 0.0)
        if not per_token:
            return losses.sum() / kept.sum()
    return losses


def next_token_accuracy(logits: torch.Tensor, tokens: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Whether each position's top logit is the next token: bool [batch, pos - 1] with `per_token`, else the
    fraction of such positions (a scalar)."""
    _check(logits, tokens)
    correct = logits[:, :-1].argmax(dim=-1) == tokens[:, 1:].to(logits.device)  # [batch, pos - 1]
    return correct if per_token else correct.float().mean()

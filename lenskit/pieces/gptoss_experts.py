"""gpt-oss's expert activation and routing rule, as functions the mixture-of-experts piece calls.

An expert computes `down(clamped_swiglu(gate, up)) + down_bias`, where `gate` and `up` are the two halves of one
biased projection; gpt-oss's checkpoints interleave them along the output axis (`gate_up_proj` [expert, d_model,
2 * d_mlp]: gate at the even columns, up at the odd ones, see `split_gate_up`). Its router is a biased linear map to
one logit per expert, then the top k logits, then a softmax over those k alone (`top_k_then_softmax`).
"""

from __future__ import annotations

import torch

ALPHA = 1.702  # gpt-oss's `swiglu_alpha`: the sigmoid's gain, so gate * sigmoid(ALPHA * gate) is close to GELU
LIMIT = 7.0  # gpt-oss's `swiglu_limit`


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2 * d_mlp] with gate and up interleaved (gpt-oss's layout) -> gate, up, each [..., d_mlp] (views)."""
    return gate_up[..., 0::2], gate_up[..., 1::2]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float = ALPHA, limit: float = LIMIT) -> torch.Tensor:
    """gpt-oss's gated activation, [..., d_mlp] each -> [..., d_mlp]: the gate is clamped from above at `limit`, the up
    projection to [-limit, limit], and (up + 1) * gate * sigmoid(alpha * gate) is returned. The + 1 is gpt-oss's: an
    up projection of zero passes the gate through."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def top_k_then_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [tokens, expert] -> (indices [tokens, k], weights [tokens, k]): the k largest logits, in descending
    order, and a softmax over those k alone, so each token's weights sum to one (gpt-oss)."""
    top, indices = logits.topk(k, dim=-1)  # [tokens, k]
    return indices, top.softmax(dim=-1)

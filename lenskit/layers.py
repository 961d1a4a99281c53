"""The pieces of a pre-LN transformer block, written out: norms, MLPs, causal attention, the block.

Architecture options (RMSNorm instead of LayerNorm, SwiGLU instead of the GELU MLP) are separate
classes chosen once in `make_norm` / `make_mlp`, so each forward reads like the maths.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .hooks import HookPoint


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias, statistics over the last axis only."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            # The fused kernel is what transformers runs; same maths, fewer passes over memory.
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # [batch, pos, 1]
        return self.hook_normalized(x / scale * self.weight + self.bias)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: no centring and no bias."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # [batch, pos, 1]
        return self.hook_normalized(x / scale * self.weight)


class GeluMLP(nn.Module):
    """GPT-2's MLP: d_model -> d_mlp -> GELU (tanh approximation) -> d_model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.approximate = cfg.gelu_approximate
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.fc_in(x))
        post = self.hook_post(F.gelu(pre, approximate=self.approximate))
        return self.fc_out(post)


class SwiGLU(nn.Module):
    """Gated MLP: fc_out(silu(gate(x)) * fc_in(x)), without biases (as in LLaMA-style models)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=False)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp], the gate's pre-activation
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.gate(x))
        linear = self.hook_pre_linear(self.fc_in(x))
        return self.fc_out(self.hook_post(F.silu(pre) * linear))


class Attention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection.

    PyTorch's fused scaled-dot-product kernel runs unless a hook needs the internals
    (q, k, v, scores or pattern); both paths compute the same function.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.n_heads * cfg.d_head)
        self.out = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model)
        self.hook_q = HookPoint()  # [batch, pos, head, d_head]
        self.hook_k = HookPoint()  # [batch, pos, head, d_head]
        self.hook_v = HookPoint()  # [batch, pos, head, d_head]
        self.hook_attn_scores = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head, d_head]
        self.hook_result = HookPoint()  # [batch, pos, head, d_model], computed only when hooked
        self._internals = (self.hook_q, self.hook_k, self.hook_v, self.hook_attn_scores, self.hook_pattern)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, pos, _ = x.shape
        q, k, v = self.qkv(x).view(batch, pos, 3, self.n_heads, self.d_head).unbind(2)  # 3 x [batch, pos, head, d_head]
        if any(h.has_hooks() for h in self._internals):
            z = self._eager(self.hook_q(q), self.hook_k(k), self.hook_v(v))
        else:
            z = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)  # [batch, pos, head, d_head]
        z = self.hook_z(z)
        if not self.hook_result.has_hooks():
            return self.out(z.reshape(batch, pos, self.n_heads * self.d_head))
        w_o = self.out.weight.T.reshape(self.n_heads, self.d_head, -1)  # [head, d_head, d_model]
        result = self.hook_result(torch.einsum("bphd,hdm->bphm", z, w_o))  # [batch, pos, head, d_model]
        return result.sum(2) + self.out.bias

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos = q.shape[1]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d_head)  # [batch, head, query_pos, key_pos]
        causal = torch.ones(pos, pos, dtype=torch.bool, device=q.device).tril()
        scores = self.hook_attn_scores(scores.masked_fill(~causal, float("-inf")))
        pattern = self.hook_pattern(scores.softmax(-1))
        return torch.einsum("bhqk,bkhd->bqhd", pattern, v)  # [batch, pos, head, d_head]


def make_norm(cfg: ModelConfig) -> nn.Module:
    return (LayerNorm if cfg.norm == "layernorm" else RMSNorm)(cfg.d_model, cfg.norm_eps)


def make_mlp(cfg: ModelConfig) -> nn.Module:
    return (GeluMLP if cfg.mlp == "gelu" else SwiGLU)(cfg)


class TransformerBlock(nn.Module):
    """Pre-LN block: each sublayer reads a normalised copy of the stream and adds its write back."""

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = make_norm(cfg)
        self.mlp = make_mlp(cfg)
        self.dropout = nn.Dropout(dropout)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.attn(self.ln1(x)))))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.dropout(self.mlp(self.ln2(x)))))
        return x

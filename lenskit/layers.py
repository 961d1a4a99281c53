"""The MLPs and the blocks that put the pieces together: sequential (pre-LN) or parallel.

Architecture options are separate classes chosen once from the config (`make_norm` in norms.py,
`Attention`'s pieces in attention.py, `make_mlp` and `make_block` here), so each forward reads
like the maths and has no family branches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .attention import Attention
from .hooks import HookPoint
from .norms import LayerNorm, RMSNorm, make_norm

__all__ = ["Attention", "GeluMLP", "LayerNorm", "ParallelBlock", "RMSNorm", "SwiGLU", "TransformerBlock",
           "make_block", "make_mlp", "make_norm"]


class GeluMLP(nn.Module):
    """GPT-2's and GPT-NeoX's MLP: d_model -> d_mlp -> GELU (the config's form) -> d_model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.approximate = cfg.gelu_approximate
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.fc_in(x))
        post = self.hook_post(F.gelu(pre, approximate=self.approximate))
        return self.fc_out(post)


class SwiGLU(nn.Module):
    """Gated MLP: fc_out(silu(gate(x)) * fc_in(x)), biases only where the config has them (Llama's `mlp_bias`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp], the gate's pre-activation
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.gate(x))
        linear = self.hook_pre_linear(self.fc_in(x))
        return self.fc_out(self.hook_post(F.silu(pre) * linear))


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


class ParallelBlock(TransformerBlock):
    """GPT-NeoX's block: attention and MLP both read the block's input (resid_pre), each through its
    own norm. resid_mid is still defined by the identity resid_mid = resid_pre + attn_out, so
    resid_post = resid_mid + mlp_out holds as for a sequential block, but the MLP never sees resid_mid."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        attn_out = self.hook_attn_out(self.dropout(self.attn(self.ln1(x))))
        mlp_out = self.hook_mlp_out(self.dropout(self.mlp(self.ln2(x))))
        return self.hook_resid_post(self.hook_resid_mid(x + attn_out) + mlp_out)


def make_block(cfg: ModelConfig, dropout: float = 0.0) -> TransformerBlock:
    return (ParallelBlock if cfg.parallel_block else TransformerBlock)(cfg, dropout)

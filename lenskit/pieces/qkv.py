"""The q/k/v projections of attention, one class per layout, chosen once by `make_qkv`: one fused projection
(`FusedQKV`: GPT-2, NeoX), three (`SplitQKV`), three with each head's output gate in q's (`GatedSplitQKV`, Qwen 3.5),
three under Falcon-H1's input and key multipliers (`ScaledSplitQKV`), keys that are also the values (`KeyValueQK`,
Gemma 4's full blocks) and a query only (`QueryOnly`, Gemma 4's blocks
that read an earlier block's keys and values). Each returns q [batch, pos, head * d_head], k and v [batch, pos,
kv_head * d_head] (and the gate), and `parts()` gives its (weight, bias) per output for the weight views."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .linear import Linear


class FusedQKV(Linear):
    """One projection to [q heads | k heads | v heads] (GPT-2; NeoX after its per-head layout is unpacked)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head, bias=cfg.attention.qkv_bias)
        self.sizes = (cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head)
        self.d_head = cfg.d_head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, pos, _ = x.shape
        q, k, v = super().forward(x).split(self.sizes, dim=-1)
        return (q.view(batch, pos, -1, self.d_head), k.view(batch, pos, -1, self.d_head),
                v.view(batch, pos, -1, self.d_head))  # [batch, pos, head | kv_head, d_head]

    def parts(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(weight [out, d_model], bias [out] or None) of q, k and v: views of the fused parameters."""
        biases = (None, None, None) if self.bias is None else self.bias.split(self.sizes)
        return tuple(zip(self.weight.split(self.sizes, dim=0), biases))


class SplitQKV(nn.Module):
    """Three projections `q`, `k`, `v` (Llama, Mistral, Qwen), as the checkpoints store them."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.d_head = d_head = cfg.d_head_of(layer)  # block `layer`'s heads (Gemma 4's full blocks have their own)
        n_kv = cfg.n_kv_heads_of(layer)
        self.q = Linear(cfg.d_model, cfg.n_heads * d_head, bias=cfg.attention.qkv_bias)
        self.k = Linear(cfg.d_model, n_kv * d_head, bias=cfg.attention.qkv_bias)
        self.v = Linear(cfg.d_model, n_kv * d_head, bias=cfg.attention.qkv_bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, pos, _ = x.shape
        return (self.q(x).view(batch, pos, -1, self.d_head), self.k(x).view(batch, pos, -1, self.d_head),
                self.v(x).view(batch, pos, -1, self.d_head))  # [batch, pos, head | kv_head, d_head]

    def parts(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(weight [out, d_model], bias [out] or None) of q, k and v."""
        return tuple((linear.weight, linear.bias) for linear in (self.q, self.k, self.v))


class GatedSplitQKV(SplitQKV):
    """SplitQKV whose `q` also gives each head an output gate (Qwen 3.5): per head, d_head query rows then d_head
    gate rows, as the checkpoints store `q_proj`. forward returns q, k, v and the gate's logits [batch, pos, head, d_head]."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        self.q = Linear(cfg.d_model, 2 * cfg.n_heads * cfg.d_head, bias=cfg.attention.qkv_bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, pos, _ = x.shape
        q, gate = self.q(x).view(batch, pos, -1, 2 * self.d_head).chunk(2, dim=-1)  # 2 x [batch, pos, head, d_head]
        return q, self.k(x).view(batch, pos, -1, self.d_head), self.v(x).view(batch, pos, -1, self.d_head), gate

    def parts(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(weight [out, d_model], bias [out] or None) of q (its query rows, a copy), k and v."""
        (weight, bias), k, v = super().parts()
        rows = lambda t: t.view(-1, 2, self.d_head, *t.shape[1:])[:, 0].reshape(-1, *t.shape[1:])  # noqa: E731
        return (rows(weight), None if bias is None else rows(bias)), k, v


class ScaledSplitQKV(SplitQKV):
    """SplitQKV under Falcon-H1's muP multipliers (`cfg.scales`): the input times `attention_in` before the three
    projections, the keys times `key` after theirs (before rotary, as transformers scales them). `parts()` gives the
    weights with the factors in (copies), so the weight views keep `x @ W_K + b_K` equal to what hook_k shows."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        self.in_multiplier, self.key_multiplier = cfg.scales.attention_in, cfg.scales.key

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().forward(x * self.in_multiplier)
        return q, k * self.key_multiplier, v

    def parts(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(weight [out, d_model], bias [out] or None) of q, k and v, with the multipliers in."""
        a, key = self.in_multiplier, self.key_multiplier
        (wq, bq), (wk, bk), (wv, bv) = super().parts()
        return ((wq * a, bq), (wk * (a * key), None if bk is None else bk * key), (wv * a, bv))


class KeyValueQK(SplitQKV):
    """SplitQKV with no `v`: the values are the keys' projection itself, before the key norm and rotary (Gemma 4's
    full blocks, `attention_k_eq_v`). forward returns q, k and k again; hook_k and hook_v both see it."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        del self.v

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, pos, _ = x.shape
        k = self.k(x).view(batch, pos, -1, self.d_head)  # [batch, pos, kv_head, d_head]
        return self.q(x).view(batch, pos, -1, self.d_head), k, k

    def parts(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """(weight [out, d_model], bias [out] or None) of q, k and v (which is k's)."""
        k = (self.k.weight, self.k.bias)
        return (self.q.weight, self.q.bias), k, k


class QueryOnly(Linear):
    """A kv-sharing block's projection (Gemma 4 E2B, E4B): its queries only, [batch, pos, head, d_head]; its keys
    and values are an earlier block's (lenskit.pieces.kv_sharing). `parts()` has no k or v."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        self.d_head = cfg.d_head_of(layer)
        super().__init__(cfg.d_model, cfg.n_heads * self.d_head, bias=cfg.attention.qkv_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).view(*x.shape[:2], -1, self.d_head)  # [batch, pos, head, d_head]

    def parts(self) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...]:
        """(weight [out, d_model], bias [out] or None) of q, then (None, None) for the k and v it does not have."""
        return (self.weight, self.bias), (None, None), (None, None)


def make_qkv(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    """Block `layer`'s projection to q, k and v: fused, gated, keys as values, or three; q only where the block
    reads an earlier block's keys and values (`cfg.kv_source`)."""
    if cfg.kv_source(layer) is not None:
        return QueryOnly(cfg, layer)
    if cfg.attention.fused_qkv:
        return FusedQKV(cfg, layer)
    if cfg.attention.output_gate:
        return GatedSplitQKV(cfg, layer)
    if cfg.scales.attention_in != 1.0 or cfg.scales.key != 1.0:
        return ScaledSplitQKV(cfg, layer)
    return KeyValueQK(cfg, layer) if cfg.k_is_v(layer) else SplitQKV(cfg, layer)

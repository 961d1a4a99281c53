"""Multi-head latent attention (MLA; DeepSeek V2/V3, Kimi K2): keys and values expanded from one small latent per
position, which is all the KV cache keeps.

    q                = q_b(rms(q_a(x)))  or  q_proj(x)                  [batch, pos, head, d_nope + d_rope]
    latent, k_rope   = kv_a(x) split [kv_lora_rank | d_rope]
    latent           = rms(latent)                                      [batch, pos, kv_lora_rank]
    k_nope, v        = kv_b(latent) per head split [d_nope | d_head]
    q_rope, k_rope   = rotate(q_rope), rotate(k_rope)                   (k_rope: one for all heads)
    k                = [k_nope | k_rope]                                [batch, pos, head, d_nope + d_rope]
    out              = o_proj(softmax(q k^T * scale + causal) v)

Widths come from `cfg.mla` (kv_lora_rank, q_lora_rank, qk_nope_head_dim = d_nope), `cfg.rope.dim` (d_rope,
transformers' qk_rope_head_dim) and `cfg.d_head` (each head's value width, v_head_dim). The two latent norms are
RMSNorms with eps 1e-6 and no config field, as transformers builds them. The scale is (d_nope + d_rope) ** -0.5,
times mscale ** 2 with mscale = 0.1 rope.mscale_all_dim ln(rope.factor) + 1 where the rotary is rescaled and
`rope.mscale_all_dim` is set (transformers' `yarn_apply_mscale`). With `mla.rope_interleave` (DeepSeek's checkpoints)
the rotated features arrive as interleaved pairs (x0, x1), (x2, x3), ...: they are first laid out as evens then odds,
after which the rotation is lenskit's rotate-half one; that is the layout transformers' interleaved rotary returns,
so q and k match its `query_states` and `key_states` exactly.

Scores, pattern, the mix, per-head results and the output projection are `lenskit.pieces.attention.Attention`'s own
path (`attend`: the fused kernel unless a hook edits, the eager one otherwise), with n_kv_heads = n_heads, so head
ablation, patching and `hook_result` work as for ordinary attention.

Hooks: `hook_q_latent` [batch, pos, q_lora_rank] (where there is a q LoRA; after its norm, what q_b reads),
`hook_kv_latent` [batch, pos, kv_lora_rank] (after its norm: what kv_b reads and the cache keeps), `hook_k_rope`
[batch, pos, d_rope] (rotated, shared by every head), `hook_q` [batch, pos, head, d_nope + d_rope] and `hook_k`
[batch, pos, head, d_nope + d_rope] (as the scores read them: rotated, rope features last), `hook_v` [batch, pos,
head, d_head]; `hook_attn_scores`, `hook_pattern` [batch, head, query_pos, key_pos], `hook_z` [batch, pos, head,
d_head], `hook_result` [batch, pos, head, d_model] as in `Attention`. With a KV cache (`lenskit.kv_cache.Latents`)
the hooks see the new positions; the cached positions' keys and values are expanded again from the cached latent, so
an edit at `hook_k` / `hook_v` changes this forward only, and an edit at `hook_kv_latent` / `hook_k_rope` also what
later forwards read.

TransformerLens's per-head `W_Q`, `W_K`, `W_V` do not exist here (a norm sits between the stream and q, k, v): they,
and per-head q/k/v inputs, are refused by name; `W_O`, `b_O` and `hook_result` are as in `Attention`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .attention import Attention, CausalMask
from .forward_state import ForwardState
from .linear import Linear
from .norms import RMSNorm
from .rotary import Rotary

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which the latent norms keep (no config field)


def _cat_head_major(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.cat([a, b], dim=-1) of two [batch, pos, head, d] tensors, stored head by head (a transposed view of a
    contiguous [batch, head, pos, d]): the layout `_head_major` gives the kernel, at no cost here. The same values."""
    return torch.cat([a.transpose(1, 2), b.transpose(1, 2)], dim=-1).transpose(1, 2)


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """x [batch, pos, head, d] stored head by head; x itself where it already is."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def softmax_scale(cfg: ModelConfig) -> float:
    """The scores' scale: (qk_nope_head_dim + rope.dim) ** -0.5, times YaRN's mscale squared where the rotary is
    rescaled and `rope.mscale_all_dim` is set, in transformers' order of operations."""
    scale = (cfg.mla.qk_nope_head_dim + cfg.rope.dim) ** -0.5
    if cfg.rope.type != "default" and cfg.rope.mscale_all_dim:
        mscale = 1.0 if cfg.rope.factor <= 1 else 0.1 * cfg.rope.mscale_all_dim * math.log(cfg.rope.factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with pairs (x0, x1), (x2, x3), ... -> [..., d] laid out x0, x2, ..., x1, x3, ...: rotate-half's pairs."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    return scores.softmax(-1)


class LatentAttention(Attention):
    """Multi-head latent attention (see the module docstring). Shares `Attention`'s scores-to-output path and weight
    views of the output; its projections, rotation and cache entry are its own, so `Attention.__init__` (which builds
    q/k/v projections) is not run."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        nn.Module.__init__(self)
        mla, d_model = cfg.mla, cfg.d_model
        if mla.kv_lora_rank is None:
            raise ValueError("LatentAttention needs cfg.mla.kv_lora_rank (latent attention's width); this config has "
                             "ordinary attention: use lenskit.pieces.attention.Attention")
        self.n_heads = self.n_kv_heads = cfg.n_heads
        self.group, self.d_head, self.layer = 1, cfg.d_head, layer
        self.d_nope, self.d_rope, self.kv_lora_rank = mla.qk_nope_head_dim, cfg.rope.dim, mla.kv_lora_rank
        d_qk = self.d_nope + self.d_rope
        if mla.q_lora_rank is None:
            self.q_proj = Linear(d_model, cfg.n_heads * d_qk, bias=False)
        else:
            self.q_a = Linear(d_model, mla.q_lora_rank, bias=cfg.attention.qkv_bias)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b = Linear(mla.q_lora_rank, cfg.n_heads * d_qk, bias=False)
            self.hook_q_latent = HookPoint()  # [batch, pos, q_lora_rank]
        self.kv_a = Linear(d_model, mla.kv_lora_rank + self.d_rope, bias=cfg.attention.qkv_bias)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b = Linear(mla.kv_lora_rank, cfg.n_heads * (self.d_nope + self.d_head), bias=False)
        self.out = Linear(cfg.n_heads * self.d_head, d_model, bias=cfg.attention.out_bias)
        self.rotary = Rotary(cfg, d_head=self.d_rope)
        self.mask = CausalMask()
        self.scale, self.softcap = softmax_scale(cfg), None
        self.hook_kv_latent = HookPoint()  # [batch, pos, kv_lora_rank]
        self.hook_k_rope = HookPoint()  # [batch, pos, d_rope]
        self.hook_q = HookPoint()  # [batch, pos, head, d_nope + d_rope]
        self.hook_k = HookPoint()  # [batch, pos, head, d_nope + d_rope]
        self.hook_v = HookPoint()  # [batch, pos, head, d_head]
        self.hook_attn_scores = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head, d_head]
        self.hook_result = HookPoint()  # [batch, pos, head, d_model], computed only when hooked
        self._internals = (self.hook_q, self.hook_k, self.hook_v, self.hook_attn_scores, self.hook_pattern)
        # Attention's steps, chosen once as there: no soft-cap, no sink, no gate
        self._cap, self._softmax, self._gate_z = _unchanged, _softmax, _unchanged
        self._fused = self._fused_head_major
        self._query = self._low_rank_query if mla.q_lora_rank is not None else self._full_query
        self._lay_out = deinterleaved if mla.rope_interleave else _unchanged

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row, as (weights, biases): the projections under `attn`, the latent norms'
        gains under `norms`."""
        mla, d, h = cfg.mla, cfg.d_model, cfg.n_heads
        d_qk, r = mla.qk_nope_head_dim + cfg.rope.dim, mla.kv_lora_rank
        q = h * d * d_qk if mla.q_lora_rank is None else mla.q_lora_rank * (d + h * d_qk)
        weights = q + d * (r + cfg.rope.dim) + r * h * (mla.qk_nope_head_dim + cfg.d_head) + h * cfg.d_head * d
        a_biases = (0 if mla.q_lora_rank is None else mla.q_lora_rank) + r + cfg.rope.dim
        biases = (a_biases if cfg.attention.qkv_bias else 0) + (d if cfg.attention.out_bias else 0)
        return {"attn": (weights, biases), "norms": (r + (mla.q_lora_rank or 0), 0)}

    @classmethod
    def core_flops(cls, cfg: ModelConfig, layer: int, n_keys: float) -> dict[str, float]:
        """FLOPs per token of the scores `q k^T` (d_nope + d_rope wide) and `pattern v` (d_head wide) against `n_keys`
        keys, as the expanded heads compute them."""
        d_qk = cfg.mla.qk_nope_head_dim + cfg.rope.dim
        return {"attn_core": 2 * n_keys * cfg.n_heads * (d_qk + cfg.d_head)}

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """Weight processing (lenskit.processing) needs per-head W_Q, W_K, W_V to refactor the heads' matrices, and
        finds no value bias to fold (kv_b has none): both are refused by name; the rest applies as to `Attention`."""
        if option == "refactor_factored_attn_matrices":
            return (f"refactor_factored_attn_matrices is not defined for latent attention ({cfg.family}): a norm sits "
                    "between the stream and q, k, v, so there is no per-head W_Q, W_K; pass "
                    "refactor_factored_attn_matrices=False", False)
        if option == "fold_value_biases":
            return (f"fold_value_biases has nothing to fold in latent attention ({cfg.family}): its values (kv_b) have "
                    "no bias; pass fold_value_biases=False", True)
        return None

    def norm_readers(self) -> list[nn.Linear]:
        """The projections that read the normalised stream, into which fold_ln folds the norm before attention: the
        query's first projection (q_a, or q_proj without a q LoRA) and kv_a."""
        return [self.q_a if hasattr(self, "q_a") else self.q_proj, self.kv_a]

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """The block's write [batch, pos, d_model] from its normed stream x [batch, pos, d_model], with the forward's
        `state` (its KV cache entry, a `lenskit.kv_cache.Latents`; None for a block alone, which has no cache)."""
        batch, pos = x.shape[:2]
        q = self._query(x).view(batch, pos, self.n_heads, -1)  # [batch, pos, head, d_nope + d_rope]
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        latent, k_rope = self.kv_a(x).split([self.kv_lora_rank, self.d_rope], dim=-1)
        latent = self.hook_kv_latent(self.kv_a_norm(latent))  # [batch, pos, kv_lora_rank]
        past = None if state is None else state.entry(self)
        start = 0 if past is None else past.n_pos
        q_rope = self.rotary(self._lay_out(q_rope), start)
        k_rope = self.hook_k_rope(self.rotary(self._lay_out(k_rope)[:, :, None], start)[:, :, 0])  # [batch, pos, d_rope]
        q = self.hook_q(_cat_head_major(q_nope, q_rope))
        k, v = self.expand(latent, k_rope)
        k, v = self.hook_k(k), self.hook_v(v)
        if past is not None:
            n_old = past.n_pos
            latents, k_ropes = past.extend(latent, k_rope)  # [batch, n_pos + pos, ...]: the cached positions, then these
            if n_old:
                k_old, v_old = self.expand(latents[:, :n_old], k_ropes[:, :n_old])
                k, v = torch.cat([k_old, k], dim=1), torch.cat([v_old, v], dim=1)
        return self.attend(q, k, v)

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [batch, pos, head, d_nope + d_rope] and values [batch, pos, head, d_head] from the latent [batch, pos,
        kv_lora_rank] and the rotated shared key part k_rope [batch, pos, d_rope]."""
        batch, pos = latent.shape[:2]
        kv = self.kv_b(latent).view(batch, pos, self.n_heads, self.d_nope + self.d_head)
        k_nope, v = kv.split([self.d_nope, self.d_head], dim=-1)
        k = _cat_head_major(k_nope, k_rope[:, :, None].expand(-1, -1, self.n_heads, -1))
        return k, v

    def _fused_head_major(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention's fused kernel with q and k stored head by head, whatever layout a hook on hook_q / hook_k
        returned: the layout in which the CPU kernel multiplies them without copies (this forward makes them so), and
        one layout for every run, so that the scores' last bits never depend on a hook's output layout."""
        return self._fused_plain(_head_major(q), _head_major(k), v)

    def _full_query(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x)

    def _low_rank_query(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_b(self.hook_q_latent(self.q_a_norm(self.q_a(x))))

    def from_projections(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *gate: torch.Tensor,
                         state: ForwardState | None = None) -> torch.Tensor:
        raise ValueError("latent attention (DeepSeek V3) has no per-head q/k/v inputs: its keys and values come from one "
                         "latent shared by every head; hook hook_kv_latent or hook_q/hook_k/hook_v instead")

    def _per_head(self, i: int, bias: bool = False) -> torch.Tensor:
        name = ("W_Q", "W_K", "W_V")[i] if not bias else ("b_Q", "b_K", "b_V")[i]
        raise ValueError(f"latent attention (DeepSeek V3) has no per-head {name}: a norm sits between the stream and "
                         "its queries, keys and values; read attn.q_b / attn.q_proj, attn.kv_a and attn.kv_b (W_O, b_O "
                         "exist)")

"""Gemma 4's kv sharing (E2B, E4B): the last `n_kv_shared_layers` blocks compute queries only and attend to the keys
and values of an earlier block, the last block before them of their own layer type (sliding or full).

The rule is `cfg.kv_source(L)` (all of them: `cfg.kv_source_layers`), and each such block names its source:
`model.blocks[L].attn.kv_source`. The source keeps its keys and values for this forward exactly as its own attention
reads them, after its key norm and rotary (its `attn.hook_rot_k`) and its value norm (`attn.v_norm.hook_normalized`),
with any cached keys first (lenskit.kv_cache), in the forward's state (lenskit.pieces.forward_state); the sharing
blocks read that same tensor, as transformers' `Gemma4TextAttention` reads its `shared_kv_states`. So an edit of the
source's hook_k, hook_rot_k or hook_v reaches every block that shares its keys.

In a sharing block, `attn.hook_k` and `attn.hook_v` [batch, key_pos, kv_head, d_head] fire on the keys and values it
reads (its source's, normed and rotated already): an edit there changes this block's attention only. Such a block has
no k/v projections, key norm, value norm or `hook_rot_k` (transformers drops them from the checkpoint too), and its
`W_K`, `W_V`, `b_K`, `b_V` are refused, naming the source block whose weights made the keys.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .attention import Attention
from .forward_state import ForwardState, needed


class SharedKVAttention(Attention):
    """Attention with queries of its own and block `kv_source`'s keys and values (see the module docstring)."""

    OWN_KV = False  # no k/v projections or key norm: the keys and values are block kv_source's

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)  # its qkv is q only (qkv.QueryOnly): make_qkv reads cfg.kv_source
        self.kv_source = cfg.kv_source(layer)
        unused = [getattr(self, name) for name in ("k_norm", "v_norm", "hook_rot_k") if hasattr(self, name)]
        for name in ("k_norm", "v_norm", "hook_rot_k"):
            if hasattr(self, name):
                delattr(self, name)
        gone = {id(h) for m in unused for h in m.modules()}
        self._internals = tuple(h for h in self._internals if id(h) not in gone)
        self._norm_q = (_same if not cfg.attention.qk_norm else self._q_norm if cfg.attention.qk_norm_per_head else self._flat_q_norm)
        self._rotate_q = self._rotate if cfg.rotates(layer) else _unrotated

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        q = self.hook_q(self.qkv(x))  # [batch, pos, head, d_head]
        state = needed(state, f"block {self.layer}'s keys and values (block {self.kv_source}'s)")
        k, v = state.shared_kv(self.kv_source, self.layer, q)  # [batch, key_pos, kv_head, d_head], as the source read them
        k, v = self.hook_k(k), self.hook_v(v)
        q = self._rotate_q(self._norm_q(q), k.shape[1] - q.shape[1])  # the queries follow any cached positions
        return self.attend(q, k, v)

    def _q_norm(self, q: torch.Tensor) -> torch.Tensor:
        return self.q_norm(q)

    def _flat_q_norm(self, q: torch.Tensor) -> torch.Tensor:
        return self.q_norm(q.flatten(2)).view_as(q)

    def _rotate(self, q: torch.Tensor, start: int) -> torch.Tensor:
        return self.hook_rot_q(self.rotary(q, start))

    def _per_head(self, i: int, bias: bool = False) -> torch.Tensor:
        if i:
            raise ValueError(f"block {self.layer} has no key or value weights: it reads block {self.kv_source}'s keys "
                             f"and values (kv sharing, attn.kv_source); use model.blocks[{self.kv_source}].attn's")
        return super()._per_head(i, bias)

    def extra_repr(self) -> str:
        return f"kv_source={self.kv_source}"


def _same(q: torch.Tensor) -> torch.Tensor:
    return q


def _unrotated(q: torch.Tensor, start: int) -> torch.Tensor:
    return q

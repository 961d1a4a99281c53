"""What one forward pass hands its blocks beside the stream, as an argument: `ForwardState`.

`HookedTransformer.forward` makes one per call and passes it down by hand, `run_blocks(x, state=state)` ->
`block(x, state)` -> `block.attn(x, state)`, as gpt-fast passes its caches. It holds:

- `cache`, the `KVCache` given as `past_kv_cache` (lenskit.kv_cache), and `start`, the position the tokens start at
  (its length; 0 without one): each attention block extends its own entry, `state.entry(self)`;
- Gemma 4's per-layer inputs (E2B, E4B; computed from the tokens before the first block, lenskit.pieces.per_layer);
- the keys and values that kv-sharing blocks read from an earlier block in this forward (lenskit.pieces.kv_sharing).

The state is a local of the call, never an attribute of a module, and the cache's entries belong to the cache the
caller passed: two threads running one model, each with its own cache, share nothing but the weights. (A cache held
on each attention module, as gpt-fast does, would be one cache per model, which two threads would overwrite.) Hooks
are the one thing that reaches the blocks through context (lenskit.observe.hook_context), since a `with
model.hooks(...)` block wraps calls whose signatures have no room for them.

A block called alone (`model.blocks[3](x)`, or `run_blocks` resuming from a stream) gets no state: it runs as in a
forward without a cache, and a block that needs the forward's own inputs (Gemma 4's per-layer inputs, shared keys) is
refused, naming what it needs.

>>> x = cache["resid_pre", 0]           # the stream entering block 0
>>> state = ForwardState()               # HookedTransformer.forward's: start, past_kv_cache, per-layer inputs
>>> x = model.run_blocks(x, state=state)
>>> torch.allclose(x, cache["resid_post", 5], atol=1e-5)   # the blocks alone, as inside the forward
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from ..kv_cache import DeltaNetState, KeyValues, KVCache, Latents


@dataclass
class ForwardState:
    """One forward's side inputs: the KV cache it extends (None: none) and the position its tokens start at, the
    per-layer inputs [batch, pos, layer, d_per_layer] (None where the model has none), and the keys and values each
    source block kept for the blocks that reuse them, by block index."""

    start: int = 0
    cache: "KVCache | None" = None
    per_layer: torch.Tensor | None = None
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def entry(self, module: "nn.Module") -> "KeyValues | Latents | DeltaNetState | None":
        """`module`'s entry in this forward's KV cache (the block whose token mixer it is), or None without a cache."""
        return None if self.cache is None else self.cache.entry_of(module)

    def per_layer_input(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """Block `layer`'s per-layer input [batch, pos, d_per_layer], on the device of `like` (the block's stream)."""
        if self.per_layer is None:
            raise _alone(f"block {layer}'s per-layer input")
        return self.per_layer[:, :, layer].to(like.device)

    def keep_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Block `layer`'s keys and values [batch, pos, kv_head, d_head], as its attention reads them, kept for this
        forward's kv-sharing blocks."""
        self.kv[layer] = (k, v)

    def shared_kv(self, source: int, reader: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values block `source` kept in this forward, for block `reader`, on the device of `like`."""
        if source not in self.kv:
            raise RuntimeError(f"block {reader} reads block {source}'s keys and values, but block {source} has not run "
                               "in this forward; run the model from its first block")
        k, v = self.kv[source]
        return k.to(like.device), v.to(like.device)


def needed(state: ForwardState | None, what: str) -> ForwardState:
    """`state`, or, for a block called without one, a one-line error saying that `what` needs the model's forward."""
    if state is None:
        raise _alone(what)
    return state


def _alone(what: str) -> RuntimeError:
    return RuntimeError(f"{what} is computed by the model's forward from the tokens; run model(tokens) (or "
                        "run_with_cache / run_with_hooks), not a block or run_blocks on its own")

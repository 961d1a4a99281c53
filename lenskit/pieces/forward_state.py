"""What one forward pass hands its blocks beside the stream: Gemma 4's per-layer inputs (E2B, E4B; computed from the
tokens before the first block, `lenskit.pieces.per_layer`) and the keys and values that kv-sharing blocks read from an
earlier block (`lenskit.pieces.kv_sharing`).

The state lives in a `contextvars` context variable, set by the model's forward for its own duration and reset in a
`finally`, never on a module: two threads running one model each see their own forward's, as they see their own hooks
(`lenskit.observe.hooks`). A block that needs the state outside a forward (a block called alone, or `run_blocks`
resuming from a stream) is refused, naming what it needs.

>>> with forward_state(per_layer=inputs):   # what HookedTransformer.forward does around its blocks
...     x = model.run_blocks(x)
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class ForwardState:
    """One forward's side inputs: the per-layer inputs [batch, pos, layer, d_per_layer] (None where the model has
    none) and the keys and values each source block kept for the blocks that reuse them, by block index."""

    per_layer: torch.Tensor | None = None
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_STATE: ContextVar[ForwardState | None] = ContextVar("lenskit_forward_state", default=None)


@contextmanager
def forward_state(per_layer: torch.Tensor | None = None) -> Iterator[ForwardState]:
    """A fresh `ForwardState` for the blocks run inside the `with`, in the calling context only."""
    state = ForwardState(per_layer)
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


def current_state(what: str) -> ForwardState:
    """The running forward's state; outside a forward, a one-line error saying that `what` needs one."""
    state = _STATE.get()
    if state is None:
        raise RuntimeError(f"{what} is computed by the model's forward from the tokens; run model(tokens) (or "
                           "run_with_cache / run_with_hooks), not a block or run_blocks on its own")
    return state


def per_layer_input(layer: int, like: torch.Tensor) -> torch.Tensor:
    """Block `layer`'s per-layer input [batch, pos, d_per_layer], on the device of `like` (the block's stream)."""
    return current_state(f"block {layer}'s per-layer input").per_layer[:, :, layer].to(like.device)


def keep_kv(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Block `layer`'s keys and values [batch, pos, kv_head, d_head], as its attention reads them, kept for this
    forward's kv-sharing blocks."""
    current_state(f"block {layer}'s keys for the blocks that share them").kv[layer] = (k, v)


def shared_kv(source: int, reader: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values block `source` kept in this forward, for block `reader`, on the device of `like`."""
    state = current_state(f"block {reader}'s keys and values (block {source}'s)")
    if source not in state.kv:
        raise RuntimeError(f"block {reader} reads block {source}'s keys and values, but block {source} has not run in "
                           f"this forward; run the model from its first block")
    k, v = state.kv[source]
    return k.to(like.device), v.to(like.device)

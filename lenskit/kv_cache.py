"""Keys and values kept across forwards, so that generation feeds each new token alone: `KVCache`.

`model(tokens, past_kv_cache=cache)` runs only the new positions: they continue from the cache's `n_pos` (learned
positions, rotary angles and the causal mask all start there), each attention block attends to its cached keys and
values followed by the new ones (a latent-attention block caches its latents, `Latents`, and expands them again), and each Gated DeltaNet block (Qwen 3.5) or Mamba-2 block (`MambaState`) carries its
causal-convolution inputs and recurrent state. Hooks see the new positions only ([batch, new_pos, ...]; attention scores and patterns
[batch, head, new_pos, n_pos + new_pos]). Without a cache the forward is exactly what it is without this module.

>>> cache = KVCache(model.cfg, batch_size=1)
>>> logits = model(prompt, past_kv_cache=cache)            # [1, pos, d_vocab]; cache.n_pos == pos
>>> step = model(logits[:, -1:].argmax(-1), past_kv_cache=cache)   # [1, 1, d_vocab], position pos

The forward hands the cache down to its blocks in its `ForwardState` (lenskit.pieces.forward_state), an argument
of each block and token mixer, and each reads its own entry there (`state.entry(self)`): the cache is the caller's,
never an attribute of the model, so threads with caches of their own never see each other's. A forward that fails
leaves the cache as it was before that forward. A frozen cache is read but not extended (several continuations of one
prefix).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F

from .config import ModelConfig

if TYPE_CHECKING:
    from torch import nn  # the model is a HookedTransformer, named by its base class: lenskit.model imports this module


class KeyValues:
    """One attention block's cached keys and values, each [batch, n_pos, kv_head, d_head] (None before any),
    as attention reads them: keys after their norm and rotation, values after their norm."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.frozen = False

    @property
    def n_pos(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values followed by the new ones k, v [batch, new_pos, kv_head, d_head]:
        [batch, n_pos + new_pos, kv_head, d_head] each, kept for the next forward unless frozen."""
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)
        if not self.frozen:
            self.keys, self.values = k, v
        return k, v

    def _saved(self) -> tuple:
        return self.keys, self.values

    def _restore(self, saved: tuple) -> None:
        self.keys, self.values = saved


class Latents:
    """One latent-attention block's cache (lenskit.pieces.latent_attention; DeepSeek V3): the normed kv latents
    `latent` [batch, n_pos, kv_lora_rank] and the rotated shared key parts `k_rope` [batch, n_pos, d_rope] (None before
    any), from which attention expands every head's keys and values again; far smaller than the expanded keys."""

    def __init__(self) -> None:
        self.latent: torch.Tensor | None = None
        self.k_rope: torch.Tensor | None = None
        self.frozen = False

    @property
    def n_pos(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def extend(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached latents and key parts followed by the new ones ([batch, new_pos, ...] each): [batch, n_pos +
        new_pos, ...] each, kept for the next forward unless frozen."""
        if self.latent is not None:
            latent, k_rope = torch.cat([self.latent, latent], dim=1), torch.cat([self.k_rope, k_rope], dim=1)
        if not self.frozen:
            self.latent, self.k_rope = latent, k_rope
        return latent, k_rope

    def _saved(self) -> tuple:
        return self.latent, self.k_rope

    def _restore(self, saved: tuple) -> None:
        self.latent, self.k_rope = saved


class DeltaNetState:
    """One Gated DeltaNet block's carried state: the last `width - 1` inputs of its causal convolution
    `conv` [batch, width - 1, channel] and the recurrent state `state` [batch, v_head, d_k, d_v] (float32);
    both None before any position, which is the fresh (zero) state."""

    def __init__(self) -> None:
        self.conv: torch.Tensor | None = None
        self.state: torch.Tensor | None = None
        self.frozen = False

    def update(self, conv_input: torch.Tensor, width: int, state: torch.Tensor) -> None:
        """Keep the last width - 1 convolution inputs (conv_input [batch, new_pos, channel], appended to the
        cached ones) and the state after the new positions, unless frozen."""
        if self.frozen:
            return
        seen = conv_input if self.conv is None else torch.cat([self.conv, conv_input], dim=1)
        keep = width - 1
        if seen.shape[1] < keep:  # fewer positions than the window so far: zeros before them, as a fresh state has
            seen = F.pad(seen, (0, 0, keep - seen.shape[1], 0))
        self.conv, self.state = seen[:, seen.shape[1] - keep:], state

    def _saved(self) -> tuple:
        return self.conv, self.state

    def _restore(self, saved: tuple) -> None:
        self.conv, self.state = saved


class MambaState(DeltaNetState):
    """One Mamba-2 block's carried state (lenskit.pieces.mamba2): the last `width - 1` inputs of its causal
    convolution `conv` [batch, width - 1, d_inner + 2 n_groups d_state] (x, B and C before the convolution) and the
    SSM state `state` [batch, head, d_head, d_state] (float32); both None before any position (the fresh, zero state)."""


class KVCache:
    """Every block's cached keys and values (or DeltaNet or Mamba-2 state) for `batch_size` sequences of one model.

    Made for a config (`KVCache(model.cfg, batch_size)`); the first forward binds it to that model instance for the
    cache's life, and any other model (even one of equal config, also once the first is garbage-collected), batch
    size, a length past n_ctx, or `stop_at_layer` is refused. `cache[l]` is block l's entry.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int = 1, device: torch.device | str | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.cfg, self.batch_size = cfg, batch_size
        self.device = None if device is None else torch.device(device)  # where the caller meant it; entries follow their block
        recurrent = {"linear": DeltaNetState, "mamba": MambaState}
        self.entries: list[KeyValues | Latents | DeltaNetState] = [
            recurrent[cfg.layer_type(layer)]() if cfg.layer_type(layer) in recurrent else Latents()
            if cfg.mla.kv_lora_rank is not None else KeyValues() for layer in range(cfg.n_layers)]
        self.n_pos = 0
        self.frozen = False
        self._model: weakref.ref | None = None
        self._layer_of: dict[nn.Module, int] = {}

    def __getitem__(self, layer: int) -> KeyValues | Latents | DeltaNetState:
        return self.entries[layer]

    def __len__(self) -> int:
        return len(self.entries)

    def freeze(self) -> None:
        """Read the cache without extending it: each later forward sees the cached prefix and its own tokens."""
        self.frozen = True
        for entry in self.entries:
            entry.frozen = True

    def unfreeze(self) -> None:
        self.frozen = False
        for entry in self.entries:
            entry.frozen = False

    def entry_of(self, module: "nn.Module") -> KeyValues | Latents | DeltaNetState | None:
        """The entry of the block whose token mixer (`blocks[l].attn`) is `module`."""
        layer = self._layer_of.get(module)
        return None if layer is None else self.entries[layer]

    def _bind(self, model: "nn.Module", tokens: torch.Tensor, stop_at_layer: int | None) -> int:
        """Check that this forward may use the cache; the position its tokens start at."""
        bound = None if self._model is None else self._model()
        if self._model is not None and bound is None:  # its keys are another model's, whatever this one's config
            raise ValueError("past_kv_cache's model was garbage-collected, and its keys belong to that model only; "
                             "make a new cache for this one: KVCache(model.cfg, batch_size)")
        if model.cfg != self.cfg or (bound is not None and bound is not model):
            raise ValueError(f"past_kv_cache was made for another model ({self.cfg.name!r}, {self.cfg.n_layers} layers)"
                             f"; make one for this model: KVCache(model.cfg, batch_size)")
        if tokens.shape[0] != self.batch_size:
            raise ValueError(f"past_kv_cache holds {self.batch_size} sequence(s) but the tokens have batch "
                             f"{tokens.shape[0]}; make a cache with batch_size={tokens.shape[0]}")
        if self.n_pos + tokens.shape[1] > self.cfg.n_ctx:  # self.cfg == model.cfg, checked above
            raise ValueError(f"past_kv_cache holds {self.n_pos} positions and {tokens.shape[1]} more would pass "
                             f"n_ctx={self.cfg.n_ctx}; start a new cache from the last n_ctx tokens")
        if stop_at_layer is not None:
            raise ValueError("past_kv_cache with stop_at_layer would leave the later blocks' entries behind; "
                             "run the whole model, or no cache")
        if bound is None:
            self._model = weakref.ref(model)
            self._layer_of = {block.attn: layer for layer, block in enumerate(model.blocks)}
        return self.n_pos


@contextmanager
def extending(cache: KVCache | None, new_pos: int) -> Iterator[None]:
    """Around the blocks of a forward given `cache` (None: nothing to do). On success the cache has grown by new_pos
    positions (unless frozen); on failure every entry is as it was."""
    if cache is None:
        yield
        return
    saved = [entry._saved() for entry in cache.entries]
    try:
        yield
    except BaseException:
        for entry, s in zip(cache.entries, saved):
            entry._restore(s)
        raise
    if not cache.frozen:
        cache.n_pos += new_pos


def start_position(cache: KVCache | None, model: "nn.Module", tokens: torch.Tensor,
                   stop_at_layer: int | None) -> int:
    """The position `tokens` [batch, new_pos] start at: 0 without a cache, else the cache's length (checked)."""
    if cache is None:
        return 0
    if not isinstance(cache, KVCache):
        raise TypeError(f"past_kv_cache must be a lenskit KVCache or None, got {type(cache).__name__}")
    return cache._bind(model, tokens, stop_at_layer)

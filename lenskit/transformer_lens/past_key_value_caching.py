"""`transformer_lens.past_key_value_caching`: TransformerLens's KV-cache names over lenskit's cache
(`lenskit.kv_cache.KVCache`), for code that builds one by hand and passes it to the forward.

>>> from lenskit.transformer_lens.past_key_value_caching import HookedTransformerKeyValueCache
>>> cache = HookedTransformerKeyValueCache.init_cache(model.cfg, model.cfg.device, batch_size=1)
>>> logits = model(tokens, past_kv_cache=cache)            # then model(next_tokens, past_kv_cache=cache)
>>> cache.freeze()                                         # read it, do not extend it
"""

from __future__ import annotations

import torch

from lenskit.config import ModelConfig
from lenskit.kv_cache import DeltaNetState, KeyValues, KVCache

from .HookedTransformerConfig import HookedTransformerConfig, to_model_config

__all__ = ["DeltaNetState", "HookedTransformerKeyValueCache", "HookedTransformerKeyValueCacheEntry"]

# One attention block's cached keys and values (`cache[l]`); a Gated DeltaNet block's entry is `DeltaNetState`.
HookedTransformerKeyValueCacheEntry = KeyValues


class HookedTransformerKeyValueCache(KVCache):
    """lenskit's KVCache under TransformerLens's name, made by `init_cache(cfg, device, batch_size)`."""

    @classmethod
    def init_cache(cls, cfg: ModelConfig | HookedTransformerConfig, device: torch.device | str | None = None,
                   batch_size: int = 1) -> "HookedTransformerKeyValueCache":
        """An empty cache for `batch_size` sequences of the model whose config is `cfg` (`model.cfg`). Each block's
        entry is made on its block's device at the first forward; `device` is recorded."""
        if isinstance(cfg, HookedTransformerConfig):
            cfg = to_model_config(cfg)[0]
        return cls(cfg, batch_size, device)

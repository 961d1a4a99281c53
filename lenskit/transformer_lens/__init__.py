"""TransformerLens 3's module paths and defaults over lenskit's computation: code written for TransformerLens 3 runs
with one import changed,

>>> import lenskit.transformer_lens as transformer_lens
>>> from lenskit.transformer_lens import HookedTransformer, ActivationCache, FactoredMatrix, utils, patching
>>> model = HookedTransformer.from_pretrained("stdlib-gpt2")   # BOS first, weights processed, as TransformerLens

Nothing here computes anything of its own: each name is lenskit's (`lenskit.HookedTransformer`,
`lenskit.ActivationCache`, `lenskit.patching` ...) with TransformerLens's defaults, names and argument orders.
See docs/howto/transformer_lens.md ("Coming from TransformerLens") for what differs and what is not provided.
"""

from . import (
               components,
               errors,
               evals,
               head_detector,
               hook_points,
               loading_from_pretrained,
               past_key_value_caching,
               patching,
               utilities,
               utils,
)
from .ActivationCache import ActivationCache
from .FactoredMatrix import FactoredMatrix
from .hook_points import HookPoint
from .HookedRootModule import HookedRootModule
from .HookedTransformer import HookedTransformer
from .HookedTransformerConfig import HookedTransformerConfig
from .past_key_value_caching import HookedTransformerKeyValueCache
from .registration import install

__all__ = ["ActivationCache", "FactoredMatrix", "HookPoint", "HookedRootModule", "HookedTransformer",
           "HookedTransformerConfig", "HookedTransformerKeyValueCache", "components", "errors", "evals", "head_detector",
           "hook_points", "install", "loading_from_pretrained", "past_key_value_caching", "patching", "utilities", "utils"]

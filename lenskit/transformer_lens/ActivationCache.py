"""`transformer_lens.ActivationCache`: the class `ActivationCache` (lenskit.observe.cache) at TransformerLens 3's module path."""

from ..observe.cache import ActivationCache

__all__ = ["ActivationCache"]

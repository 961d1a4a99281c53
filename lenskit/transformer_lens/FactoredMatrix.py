"""`transformer_lens.FactoredMatrix`: the class `FactoredMatrix` (lenskit.factored), at TransformerLens 3's module path."""

from ..factored import FactoredMatrix

__all__ = ["FactoredMatrix"]

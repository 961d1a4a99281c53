"""`transformer_lens.components.mlps`."""

from .can_be_used_as_mlp import CanBeUsedAsMLP

__all__ = ["CanBeUsedAsMLP"]

"""`transformer_lens.components.mlps.can_be_used_as_mlp.CanBeUsedAsMLP`: what SAELens annotates a block's MLP with.
Every lenskit MLP piece, dense or mixture of experts, is an instance."""

from __future__ import annotations

import abc
from typing import Any

from lenskit.pieces.layers import MLP as _MLP
from lenskit.pieces.moe import MoE as _MoE


class Role(abc.ABCMeta):
    """The metaclass of the namespace's component names: an instance is one of `cls._pieces` for which `cls._when`
    holds (or any subclass's instance, as usual). Nothing is registered, so lenskit's classes stay as they are."""

    def __instancecheck__(cls, instance: Any) -> bool:
        if isinstance(instance, cls.__dict__.get("_pieces", ())):
            when = cls.__dict__.get("_when")
            return when is None or bool(when(instance))
        return super().__instancecheck__(instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        # A class is a subclass only where every instance would be one: not for a role chosen per instance.
        pieces = cls.__dict__.get("_pieces", ())
        if isinstance(subclass, type) and pieces and cls.__dict__.get("_when") is None and issubclass(subclass, pieces):
            return True
        return super().__subclasscheck__(subclass)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"transformer_lens.components.{cls.__name__} is for isinstance checks on lenskit's pieces; "
                        "lenskit builds a model's pieces from its config (lenskit.transformer_lens.HookedTransformer)")


class CanBeUsedAsMLP(abc.ABC, metaclass=Role):
    """Any MLP piece of a block (dense, gated, mixture of experts)."""

    _pieces = (_MLP, _MoE)
    _when = None

"""`transformer_lens.HookedRootModule`: the module path TransformerLens 3 gives `HookedRootModule`
(lenskit.observe.hooks; the same class as `hook_points.HookedRootModule`)."""

from ..observe.hooks import HookedRootModule

__all__ = ["HookedRootModule"]

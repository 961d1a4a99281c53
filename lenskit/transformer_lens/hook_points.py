"""`transformer_lens.hook_points`: `HookPoint` and `HookedRootModule` at TransformerLens 3's module path (lenskit.observe.hooks,
with the administration `add_hook`, `run_with_hooks`, `run_with_cache` ...)."""

from ..observe.hooks import HookedRootModule, HookPoint, LensHandle, NamesFilter

__all__ = ["HookPoint", "HookedRootModule", "LensHandle", "NamesFilter"]

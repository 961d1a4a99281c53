"""`transformer_lens.direct_path_patching`, where TransformerLens's direct-path demo imports it from: the functions
are `lenskit.transformer_lens.patching`'s (see its docstring)."""

from .patching import get_act_patch_direct_path, get_act_patch_direct_path_all_sources

__all__ = ["get_act_patch_direct_path", "get_act_patch_direct_path_all_sources"]

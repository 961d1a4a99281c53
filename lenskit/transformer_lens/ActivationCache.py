"""`transformer_lens.ActivationCache`: lenskit's `ActivationCache` (lenskit.observe.cache) at TransformerLens 3's
module path, with two TransformerLens behaviours that lenskit's own cache does not copy:

- `stack_head_results` / `stack_neuron_results(layer=0, incl_remainder=True)` give, as TransformerLens does, one
  "remainder" component equal to the FINAL stream (`resid_post` of the last block): TransformerLens reads the
  remainder at `resid_post` of layer - 1, which for layer 0 wraps round to the last block. lenskit's cache gives
  the stream entering block 0 (what the heads before block 0, none, leave), and keeps that definition.
- where TransformerLens asserts (`remove_batch_dim` on a batch of several sequences), the error is also an
  `AssertionError` (lenskit.transformer_lens.errors).

The namespace's `HookedTransformer.run_with_cache` returns this class.
"""

from __future__ import annotations

from typing import Any

import torch

from ..observe.cache import ActivationCache as LenskitActivationCache
from ..observe.slices import apply_slice
from ..observe.stream import Stream
from .errors import asserts

__all__ = ["ActivationCache"]


class ActivationCache(LenskitActivationCache):
    """lenskit's cache with TransformerLens's layer-0 remainder and assertion types (see the module's docstring)."""

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: Any = None, apply_ln: bool = False) -> Any:
        if layer == 0 and incl_remainder:
            return self._final_stream_as_remainder(return_labels, pos_slice, apply_ln)
        return super().stack_head_results(layer, return_labels, incl_remainder, pos_slice, apply_ln)

    def stack_neuron_results(self, layer: int, pos_slice: Any = None, neuron_slice: Any = None,
                             return_labels: bool = False, incl_remainder: bool = False, apply_ln: bool = False,
                             project_output_onto: torch.Tensor | None = None, mlp_input: bool = False) -> Any:
        if layer == 0 and incl_remainder and project_output_onto is None and not mlp_input:
            return self._final_stream_as_remainder(return_labels, pos_slice, apply_ln)
        return super().stack_neuron_results(layer, pos_slice, neuron_slice, return_labels, incl_remainder,
                                            apply_ln, project_output_onto, mlp_input)

    def _final_stream_as_remainder(self, return_labels: bool, pos_slice: Any, apply_ln: bool) -> Any:
        """TransformerLens's layer-0 stack: no heads or neurons, and the last block's output as the remainder
        [1, batch, pos, d_model]; `apply_ln` with block 0's ln1 scale, as TransformerLens applies it."""
        final = self[Stream(self.n_layers).hook_name(self.n_layers)]
        stack = apply_slice(final, pos_slice, -2)[None]
        stack = self.apply_ln_to_stack(stack, 0, pos_slice=pos_slice) if apply_ln else stack
        return (stack, ["remainder"]) if return_labels else stack

    @asserts
    def remove_batch_dim(self, batch_size: int | None = None) -> "ActivationCache":
        return super().remove_batch_dim(batch_size)

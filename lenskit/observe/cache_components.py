"""The cache's writes of single heads and single neurons, with TransformerLens's names, arguments and labels (a mixin
of `ActivationCache`): `compute_head_results`, `stack_head_results`, `get_neuron_results`, `stack_neuron_results`.

A head's write is its z through its slice of W_O (`attn.hook_result`, [batch, pos, head, d_model]); the heads sum
to `attn_out` less the output bias b_O. A neuron's write is its activation (`mlp.hook_post`) times its row of W_out;
the neurons sum to `mlp_out` less b_out. Neither sum reaches the stream as it is where a norm follows the sublayer
(Gemma's sandwich, OLMo 2: `ln1_post`, `ln2_post`), and a linear-attention layer has no heads and an expert layer
no fixed neurons, so those are refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .names import head_label, hook_name
from .resid import headless, need, pinned_norm, post_normed
from .slices import PosSlice, Slice, apply_slice
from .stream import Stream, check_layer

if TYPE_CHECKING:
    from torch import nn

    from .cache import ActivationCache
    from .cache_resid import Stacked


class ComponentStacks:
    """Mixin for `ActivationCache`: heads' and neurons' writes to the stream, one by one."""

    def _model(self: "ActivationCache", what: str) -> "nn.Module":
        if self.model is None:
            raise ValueError(f"{what} needs the model's weights, and this cache was built without a model; "
                             "get the cache from model.run_with_cache, or pass ActivationCache(cache_dict, model)")
        return self.model

    # ------------------------------------------------------------------ heads
    def _reaching_heads(self: "ActivationCache", layer: int, what: str) -> None:
        """Refuse block `layer` where its heads' writes are not what reaches the stream."""
        if post_normed(self, layer):
            raise ValueError(f"{what}: block {layer} normalises attention's output (ln1_post) after its heads are "
                             "summed, so the heads' writes do not add up to what reaches the stream; use "
                             "decompose_resid for whole-layer writes")
        if kind := headless(self, layer):
            raise ValueError(f"{what}: block {layer} is a {kind} layer, which has no heads' writes; use "
                             "decompose_resid for whole-layer writes")

    def _head_result(self: "ActivationCache", layer: int, what: str) -> torch.Tensor:
        """Block `layer`'s `attn.hook_result` [batch, pos, head, d_model], computed from its z and W_O and kept in
        the cache where the run did not record it."""
        name = hook_name("result", layer)
        if name not in self._store:
            z = need(self, hook_name("z", layer), what)  # [batch, pos, head, d_head]
            W_O = self._model(what).blocks[layer].attn.W_O.detach().to(z.device)  # [head, d_head, d_model]
            dtype = torch.promote_types(z.dtype, W_O.dtype)
            self._store[name] = torch.einsum("...hd,hdm->...hm", z.to(dtype), W_O.to(dtype))
        return self._store[name]

    def compute_head_results(self: "ActivationCache") -> None:
        """Add every attention block's `attn.hook_result` [batch, pos, head, d_model] that the run did not record,
        from its cached z and the model's W_O, as the model's own hook computes it (summed over heads, plus b_O, it
        is the attention's output). Blocks without heads (linear attention) have none and are skipped."""
        for layer in range(self.n_layers):
            if not headless(self, layer):
                self._head_result(layer, "compute_head_results")

    def stack_head_results(self: "ActivationCache", layer: int = -1, return_labels: bool = False,
                           incl_remainder: bool = False, pos_slice: PosSlice = None, apply_ln: bool = False) -> "Stacked":
        """Every head's write to the stream in blocks before `layer`: [layer * head, batch, pos, d_model],
        labels "L0H0", "L0H1", ... `incl_remainder` adds the rest of the stream at the input of `layer`
        (embeddings, MLPs, biases), so the stack sums to it. Heads' writes the run did not record are computed
        from z (`compute_head_results`). `apply_ln` applies the norm at `layer`'s input (`apply_ln_to_stack`).

        Refused for a model that normalises attention's output before adding it (Gemma 2/3, OLMo 2: `ln1_post`),
        whose heads' writes do not add up to what reaches the stream, and for linear-attention blocks.
        """
        layer = self._upto(layer, "stack_head_results")
        heads, labels = [], []
        for l in range(layer):
            self._reaching_heads(l, "stack_head_results")
            result = self._head_result(l, "stack_head_results")  # [..., pos, head, d_model]
            heads += list(result.movedim(-2, 0))
            labels += [head_label(l, h) for h in range(result.shape[-2])]
        stack = self._stack(heads, pos_slice, -2)
        if incl_remainder:
            total = apply_slice(need(self, Stream(layer).hook_name(self.n_layers), "stack_head_results"), pos_slice, -2)
            stack = torch.cat([stack, (total - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    # ------------------------------------------------------------------ neurons
    def _neurons(self: "ActivationCache", layer: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `layer`'s neuron activations [batch, pos, d_mlp] and W_out [d_mlp, d_model], on the same device."""
        model = self._model(what)
        if model.cfg.is_moe_layer(layer):
            raise ValueError(f"{what}: block {layer} is a mixture of experts, whose neurons are each expert's and "
                             "change with the routing; use decompose_resid (or expand_neurons=False) for its whole write")
        if post_normed(self, layer, "ln2_post"):
            raise ValueError(f"{what}: block {layer} normalises its MLP's output (ln2_post) after the neurons are "
                             "summed, so the neurons' writes do not add up to what reaches the stream; use "
                             "decompose_resid (or expand_neurons=False) for whole-layer writes")
        post = need(self, hook_name("post", layer), what)  # [batch, pos, d_mlp]
        return post, model.blocks[layer].mlp.W_out.detach().to(post.device)

    def get_neuron_results(self: "ActivationCache", layer: int, neuron_slice: PosSlice = None,
                           pos_slice: PosSlice = None, project_output_onto: torch.Tensor | None = None) -> torch.Tensor:
        """Each neuron's write to the stream in block `layer`: [batch, pos, d_mlp, d_model] (the neurons and
        positions `neuron_slice` and `pos_slice` select). With `project_output_onto` [d_model] or [d_model, n_out],
        each write's projection instead: [batch, pos, d_mlp] or [batch, pos, d_mlp, n_out], without forming the writes.
        """
        layer = check_layer(layer, self.n_layers)
        post, W_out = self._neurons(layer, "get_neuron_results")
        neuron_slice = Slice(neuron_slice)
        acts = neuron_slice.apply(apply_slice(post, pos_slice, -2), -1)  # positions first: an int drops their axis
        W_out = neuron_slice.apply(W_out, 0)  # [neuron, d_model]
        if project_output_onto is not None:
            W_out = W_out @ project_output_onto.to(W_out)  # [neuron] or [neuron, n_out]
            if project_output_onto.ndim == 1:
                return acts * W_out.to(acts.dtype)
        return acts[..., None] * W_out.to(acts.dtype)

    def stack_neuron_results(self: "ActivationCache", layer: int, pos_slice: PosSlice = None,
                             neuron_slice: PosSlice = None, return_labels: bool = False, incl_remainder: bool = False,
                             apply_ln: bool = False, project_output_onto: torch.Tensor | None = None,
                             mlp_input: bool = False) -> "Stacked":
        """Every neuron's write to the stream in blocks before `layer` (None or -1: all blocks):
        [layer * d_mlp, batch, pos, d_model], labels "L0N0", "L0N1", ... `neuron_slice` selects neurons in each block.
        `incl_remainder` adds the rest of the stream at the input of block `layer` (its MLP's with `mlp_input`),
        so the stack sums to it. `apply_ln` applies the norm there (`apply_ln_to_stack`). `project_output_onto`
        [d_model] or [d_model, n_out] replaces each write by its projection (the norm, if any, applied first).
        """
        layer = self._upto(layer, "stack_neuron_results")
        if mlp_input and layer == self.n_layers:
            raise ValueError("mlp_input=True names block `layer`'s MLP input; the final stream (layer = n_layers) has none")
        neuron_slice = Slice.unwrap(neuron_slice)
        if neuron_slice.mode == "int":  # the layers are concatenated along the neuron axis, which must stay
            neuron_slice = Slice([neuron_slice.slice])
        project = None if project_output_onto is None else project_output_onto.reshape(project_output_onto.shape[0], -1)
        parts, labels = [], []
        for l in range(layer):
            if apply_ln and project is not None:
                parts.append(self._neurons_through_norm(l, layer, mlp_input, neuron_slice, pos_slice, project))
            else:
                parts.append(self.get_neuron_results(l, neuron_slice, pos_slice, project))
            labels += [f"L{l}N{i}" for i in neuron_slice.indices(self.model.blocks[l].mlp.W_out.shape[0])]
        like = self._like(pos_slice)
        width = like.shape[-1] if project is None else project.shape[-1]
        stack = torch.cat(parts, -2).movedim(-2, 0) if parts else like.new_zeros(0, *like.shape[:-1], width)
        if apply_ln and project is None:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        if incl_remainder:
            target = Stream(layer, "resid_mid") if mlp_input else Stream(layer)
            total = apply_slice(need(self, target.hook_name(self.n_layers), "stack_neuron_results"), pos_slice, -2)[None]
            total = self.apply_ln_to_stack(total, layer, mlp_input=mlp_input, pos_slice=pos_slice) if apply_ln else total
            total = total if project is None else total @ project.to(total)
            stack = torch.cat([stack, total - stack.sum(0, keepdim=True)])
            labels.append("remainder")
        stack = stack if project_output_onto is None or project_output_onto.ndim != 1 else stack.squeeze(-1)
        return (stack, labels) if return_labels else stack

    def _neurons_through_norm(self: "ActivationCache", l: int, layer: int, mlp_input: bool, neuron_slice: Slice,
                              pos_slice: PosSlice, project: torch.Tensor) -> torch.Tensor:
        """Block l's neurons' writes through the norm at `layer`'s input, at its cached scale s, projected:
        norm_s(a_i W_out_i) @ p = (a_i / s) * (norm_1(W_out_i) @ p), since the pinned norm is linear and divides by
        s, so no [..., d_mlp, d_model] tensor is formed. [batch, pos, neuron, n_out]."""
        post, W_out = self._neurons(l, "stack_neuron_results")
        norm = self._norm(layer, mlp_input, "stack_neuron_results")
        scale = apply_slice(need(self, norm.hook_scale.name, "stack_neuron_results"), pos_slice, -2)  # [batch, pos, 1]
        W_out = neuron_slice.apply(W_out, 0)
        read = pinned_norm(norm, W_out, W_out.new_ones(1), self.model) @ project.to(W_out)  # [neuron, n_out]
        acts = neuron_slice.apply(apply_slice(post, pos_slice, -2), -1)
        return (acts / scale.to(acts))[..., None] * read.to(acts)

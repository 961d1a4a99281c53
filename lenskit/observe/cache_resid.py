"""The cache's stacks of the residual stream, with TransformerLens's names, arguments and labels (a mixin of
`ActivationCache`): the stream after each block (`accumulated_resid`), the writes that sum to it (`decompose_resid`,
`get_full_resid_decomposition`), a norm applied to such a stack (`apply_ln_to_stack`) and each part's direct logit
attribution (`logit_attrs`).

Layers follow TransformerLens's stack convention: `layer` is the input of block `layer`, 0..n_layers, n_layers (or
None, or -1) the final stream. A stack is [component, batch, pos, d_model]; an int `pos_slice` drops the pos axis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import torch

from .resid import LATE_WRITES, Part, need, pinned_norm, resid_parts
from .slices import PosSlice, Slice, as_int, apply_slice
from .stream import Stream

if TYPE_CHECKING:
    from torch import nn

    from .cache import ActivationCache

Stacked = Union[torch.Tensor, tuple[torch.Tensor, list[str]]]  # a stack, or (stack, labels) with return_labels


class ResidStacks:
    """Mixin for `ActivationCache`: stacks of the residual stream and its parts."""

    # ------------------------------------------------------------------ shared by the stacks
    def _upto(self: "ActivationCache", layer: int | None, what: str) -> int:
        """TransformerLens's `layer` for stacks: the input of block `layer`, 0..n_layers; None or -1 = all of them."""
        n = self.n_layers
        layer = layer if as_int(layer) is None else as_int(layer)
        if layer is None or layer == -1:
            return n
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
            raise ValueError(f"{what}: layer must be 0..{n} (the input of that block; {n} = the final stream) "
                             f"or None / -1 for all, got {layer!r}")
        return layer

    def _stack(self: "ActivationCache", parts: list[torch.Tensor], pos_slice: PosSlice, pos_dim: int) -> torch.Tensor:
        """[component, ...] from tensors with positions at `pos_dim`; an empty stack keeps the embedding's shape."""
        if not parts:
            like = self._like(pos_slice)
            return like.new_zeros(0, *like.shape)
        return torch.stack([apply_slice(t, pos_slice, pos_dim) for t in parts])

    def _like(self: "ActivationCache", pos_slice: PosSlice) -> torch.Tensor:
        """The token embedding with `pos_slice` applied: the shape [batch, pos, d_model] of one stack entry."""
        return apply_slice(need(self, "hook_embed", "an empty stack"), pos_slice, -2)

    def _norm(self: "ActivationCache", layer: int, mlp_input: bool, what: str) -> "nn.Module":
        """The norm that reads the input of block `layer` (ln1, ln2 with `mlp_input`; ln_final at n_layers)."""
        if self.model is None:
            raise ValueError(f"{what} needs the model's norms, and this cache was built without a model; "
                             "get the cache from model.run_with_cache, or pass ActivationCache(cache_dict, model)")
        if layer == self.n_layers:
            if mlp_input:
                raise ValueError("mlp_input=True names block `layer`'s MLP input; the final stream (layer = n_layers) has none")
            return self.model.ln_final
        if mlp_input and self.model.cfg.parallel_block:
            raise ValueError(f"{what}: block {layer} is a parallel block, whose MLP reads resid_pre through ln2 as "
                             "attention does, not resid_mid; so no norm reads resid_mid: pass mlp_input=False")
        name = "ln2" if mlp_input else "ln1"
        norm = getattr(self.model.blocks[layer], name, None)
        if norm is None:
            raise ValueError(f"{what}: block {layer} has no {name}: its sublayers read the raw stream and their outputs "
                             f"are normalised ({name}_post), so no norm reads this stream; use apply_ln=False, or the "
                             "final norm (layer=None)")
        return norm

    # ------------------------------------------------------------------ the stacks
    def accumulated_resid(self: "ActivationCache", layer: int | None = None, incl_mid: bool = False,
                          apply_ln: bool = False, pos_slice: PosSlice = None, mlp_input: bool = False,
                          return_labels: bool = False) -> Stacked:
        """The residual stream after 0..layer blocks, stacked: [layer + 1, batch, pos, d_model].

        Index l is `resid_pre` of block l (label "l_pre"); with the default layer (None or -1) the last entry
        is the final block's `resid_post` ("final_post"). `incl_mid` interleaves each earlier block's
        `resid_mid` ("l_mid"); `mlp_input` appends block `layer`'s `resid_mid`. `pos_slice` selects positions.

        `apply_ln=True`, as in TransformerLens 4.3: for the final stream (layer None / -1 / n_layers) every stream
        goes through the whole final norm, its scale computed from that stream (the logit lens: `model.unembed(stack)`
        gives each stream's logits); for an earlier `layer`, through block `layer`'s ln1 (ln2 with `mlp_input`) with
        the scale it cached (`apply_ln_to_stack`).
        """
        layer = self._upto(layer, "accumulated_resid")
        chosen: list[Stream] = []
        for l in range(layer + 1):
            chosen.append(Stream(l))
            if (incl_mid and l < layer) or (mlp_input and l == layer):
                chosen.append(Stream(l, "resid_mid"))
        labels = ["final_post" if s.layer == self.n_layers else f"{s.layer}_{s.point[6:]}" for s in chosen]
        stack = self._stack([need(self, s.hook_name(self.n_layers), "accumulated_resid") for s in chosen], pos_slice, -2)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice,
                                           recompute_ln=layer == self.n_layers)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self: "ActivationCache", layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: PosSlice = None, incl_embeds: bool = True,
                        return_labels: bool = False) -> Stacked:
        """The input of block `layer` (its MLP's with `mlp_input`) as a stack of the writes that sum to it:
        [component, batch, pos, d_model], labels "embed", "pos_embed" (learned positions only), "l_attn_out",
        "l_mlp_out" (and a block's late writes, "l_rescale_out", see `lenskit.observe.resid`). `mode` keeps "all",
        only "attn" or only "mlp" writes; `incl_embeds` keeps the embeddings.
        `apply_ln` applies that input's norm with its cached scale (`apply_ln_to_stack`).
        """
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        layer = self._upto(layer, "decompose_resid")
        if mlp_input and layer == self.n_layers:
            raise ValueError("mlp_input=True names block `layer`'s MLP input; the final stream (layer = n_layers) has none")
        s = Stream(layer, "resid_mid" if mlp_input else "resid_pre")
        keep = {"embed", "pos_embed"} if incl_embeds else set()
        keep |= {"attn", "mlp", *LATE_WRITES} if mode == "all" else {mode}
        parts: list[Part] = [p for p in resid_parts(self, s) if p.kind in keep]
        stack = self._stack([p.tensor for p in parts], pos_slice, -2)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, [p.label for p in parts]) if return_labels else stack

    def apply_ln_to_stack(self: "ActivationCache", residual_stack: torch.Tensor, layer: int | None = None,
                          mlp_input: bool = False, pos_slice: PosSlice = None, batch_slice: PosSlice = None,
                          has_batch_dim: bool = True, recompute_ln: bool = False) -> torch.Tensor:
        """Each component of `residual_stack` [component, batch, pos, d_model] through the norm that reads the
        input of block `layer` (ln1, or ln2 with `mlp_input`; the final norm for layer n_layers / None / -1),
        with the scale the whole stream gave that norm (its cached `hook_scale`), without the norm's bias.

        The components of a decomposition then sum to the norm's output less its bias. Unlike
        TransformerLens, which divides by the scale only (its default model has the gain folded into the next
        weights), lenskit applies the norm's gain too, so the same call is right on raw weights; on a processed
        model (`fold_ln=True`) the gain is 1 and the two agree. `pos_slice` and `batch_slice` say which positions
        and sequences the stack holds (already applied to it; `batch_slice` is applied to the stack too).

        `recompute_ln=True` with the final norm runs the whole norm on each component, its scale computed from
        that component and its bias included, as the logit lens does; for an earlier layer it changes nothing.
        """
        layer = self._upto(layer, "apply_ln_to_stack")
        norm = self._norm(layer, mlp_input, "apply_ln_to_stack")
        batch_slice = Slice(batch_slice)
        d_model = self.model.cfg.d_model
        if not isinstance(residual_stack, torch.Tensor) or residual_stack.ndim < 1 or residual_stack.shape[-1] != d_model:
            raise ValueError(f"apply_ln_to_stack: residual_stack must be a tensor [component, batch, pos, d_model={d_model}], "
                             f"got {tuple(getattr(residual_stack, 'shape', ())) or type(residual_stack).__name__}")
        if has_batch_dim:
            residual_stack = batch_slice.apply(residual_stack, 1)
        if recompute_ln and layer == self.n_layers:
            return norm(residual_stack)
        scale = apply_slice(need(self, norm.hook_scale.name, "apply_ln_to_stack"), pos_slice, -2)  # [batch, pos, 1]
        if self.has_batch_dim:
            scale = batch_slice.apply(scale, 0)
        try:  # the cached scale must broadcast into the stack, never the stack be widened by it
            fits = torch.broadcast_shapes(residual_stack.shape[:-1], scale.shape[:-1]) == residual_stack.shape[:-1]
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"apply_ln_to_stack: residual_stack {tuple(residual_stack.shape)} does not line up with the "
                             f"cached scale [batch, pos] {tuple(scale.shape[:-1])}; pass [component, batch, pos, d_model] "
                             "for the positions and sequences that pos_slice and batch_slice select")
        return pinned_norm(norm, residual_stack, scale, self.model)

    def logit_attrs(self: "ActivationCache", residual_stack: torch.Tensor, tokens: "str | int | torch.Tensor",
                    incorrect_tokens: "str | int | torch.Tensor | None" = None, pos_slice: PosSlice = None,
                    batch_slice: PosSlice = None, has_batch_dim: bool = True) -> torch.Tensor:
        """Each component's direct logit attribution: `residual_stack` [component, batch, pos, d_model] through the
        final norm at its cached scale (`apply_ln_to_stack`), dotted with the unembedding column of `tokens`, less
        that of `incorrect_tokens` where given: [component, batch, pos].

        `tokens` is a token (text of one token, an id, a 0-d tensor), a [batch] tensor (one per sequence, for every
        position), a [pos] tensor where its length is not the batch size, or [batch, pos]. `pos_slice` and
        `batch_slice` say which positions and sequences the stack holds, as for `apply_ln_to_stack`.
        """
        directions = residual_directions(self.model, tokens)
        if incorrect_tokens is not None:
            wrong = residual_directions(self.model, incorrect_tokens)
            if wrong.shape != directions.shape:
                raise ValueError(f"tokens and incorrect_tokens must have the same shape, got {tuple(directions.shape[:-1])} "
                                 f"and {tuple(wrong.shape[:-1])}; pass one incorrect token for each correct one")
            directions = directions - wrong
        scaled = self.apply_ln_to_stack(residual_stack, None, pos_slice=pos_slice, batch_slice=batch_slice,
                                        has_batch_dim=has_batch_dim)
        per_sequence = (has_batch_dim and Slice(batch_slice).mode != "int" and scaled.ndim == 4
                        and directions.ndim == 2 and directions.shape[0] == scaled.shape[1])
        if per_sequence:  # [batch, d_model]: one token per sequence, the same at every position
            directions = directions.unsqueeze(-2)
        return (scaled * directions.to(scaled.device, scaled.dtype)).sum(-1)

    def get_full_resid_decomposition(self: "ActivationCache", layer: int | None = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False, pos_slice: PosSlice = None,
                                     return_labels: bool = False, project_output_onto: torch.Tensor | None = None,
                                     ) -> Stacked:
        """The input of block `layer` (its MLP's with `mlp_input`) as every head's write ("L0H0" ...), every
        neuron's ("L0N0" ..., or each MLP's whole write "0_mlp_out" without `expand_neurons`), "embed", "pos_embed"
        (learned positions only) and "bias", the output biases those writes leave out: [component, batch, pos,
        d_model]; the components sum to that stream.

        `apply_ln` applies that input's norm at its cached scale (`apply_ln_to_stack`). `project_output_onto`
        [d_model] or [d_model, n_out] replaces each component's d_model axis by its projection (a 1-d direction's
        axis is dropped), without forming the [..., d_mlp, d_model] neuron writes.
        """
        layer = self._upto(layer, "get_full_resid_decomposition")
        if mlp_input and layer == self.n_layers:
            raise ValueError("mlp_input=True names block `layer`'s MLP input; the final stream (layer = n_layers) has none")
        project = None if project_output_onto is None else project_output_onto.reshape(project_output_onto.shape[0], -1)

        def finish(stack: torch.Tensor) -> torch.Tensor:  # the norm, then the projection
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice) if apply_ln else stack
            return stack if project is None else stack @ project.to(stack.device, stack.dtype)

        heads, labels = self.stack_head_results(layer + mlp_input, return_labels=True, pos_slice=pos_slice)
        parts = [finish(heads)]
        if expand_neurons:
            neurons, neuron_labels = self.stack_neuron_results(layer, pos_slice=pos_slice, return_labels=True,
                                                               apply_ln=apply_ln, project_output_onto=project,
                                                               mlp_input=mlp_input)
            parts.append(neurons)
        else:
            neurons, neuron_labels = self.decompose_resid(layer, mlp_input=mlp_input, mode="mlp", pos_slice=pos_slice,
                                                          incl_embeds=False, return_labels=True)
            parts.append(finish(neurons))
        labels += neuron_labels
        embeds = resid_parts(self, Stream(0))  # embed, and pos_embed where positions are learned
        parts.append(finish(self._stack([p.tensor for p in embeds], pos_slice, -2)))
        labels += [p.label for p in embeds]
        like = self._like(pos_slice)
        parts.append(finish(self._output_bias(layer, mlp_input, expand_neurons).to(like)[None].expand(1, *like.shape)))
        labels.append("bias")
        stack = torch.cat(parts)
        stack = stack if project_output_onto is None or project_output_onto.ndim != 1 else stack.squeeze(-1)
        return (stack, labels) if return_labels else stack

    def _output_bias(self: "ActivationCache", layer: int, mlp_input: bool, mlp_biases: bool) -> torch.Tensor:
        """The output biases that reach the input of block `layer` (its MLP's with `mlp_input`): every earlier
        attention's `b_O` (block `layer`'s too with `mlp_input`) and, with `mlp_biases`, every earlier MLP's `b_out`
        [d_model]. Heads' and neurons' writes leave them out."""
        if self.model is None:
            raise ValueError("get_full_resid_decomposition needs the model's biases, and this cache was built without a "
                             "model; get the cache from model.run_with_cache, or pass ActivationCache(cache_dict, model)")
        return self.model.accumulated_bias(layer, mlp_input, mlp_biases).detach()  # [d_model]


def residual_directions(model: "nn.Module | None", tokens: "str | int | torch.Tensor") -> torch.Tensor:
    """The unembedding columns of `tokens`, the directions the model reads each token's logit from: [d_model] for
    one token (text of one token, an id, a tensor of one id), else [*tokens.shape, d_model]."""
    if model is None:
        raise ValueError("logit_attrs needs the model's unembedding, and this cache was built without a model; "
                         "get the cache from model.run_with_cache, or pass ActivationCache(cache_dict, model)")
    return model.tokens_to_residual_directions(tokens).detach()  # [d_model] or [*tokens.shape, d_model]

"""ActivationCache: a mapping from hook names to the tensors a forward pass produced, read-only to item assignment;
the one thing added later is the heads' writes, `attn.hook_result`, computed from z where a stack needs them (as
TransformerLens does, `compute_head_results`).

The class reads top to bottom: the mapping (keys, shorthand, moving and slicing), then TransformerLens's stacks with
its names, arguments and labels: of the residual stream (`accumulated_resid`, `decompose_resid`,
`apply_ln_to_stack`, `logit_attrs`, `get_full_resid_decomposition`) and of single heads and neurons
(`compute_head_results`, `stack_head_results`, `get_neuron_results`, `stack_neuron_results`). Which writes sum to a
stream, and the norm pinned to a recorded scale, are lenskit.observe.resid's.

Layers follow TransformerLens's stack convention: `layer` is the input of block `layer`, 0..n_layers, n_layers (or
None, or -1) the final stream. A stack is [component, batch, pos, d_model]; an int `pos_slice` drops the pos axis.

A head's write is its z through its slice of W_O (`attn.hook_result`, [batch, pos, head, d_model]); the heads sum
to `attn_out` less the output bias b_O. A neuron's write is its activation (`mlp.hook_post`) times its row of W_out;
the neurons sum to `mlp_out` less b_out. Neither sum reaches the stream as it is where a norm follows the sublayer
(Gemma's sandwich, OLMo 2: `ln1_post`, `ln2_post`), and a linear-attention layer has no heads and an expert layer
no fixed neurons, so those are refused by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Iterator, Union

import torch

from ..suggest import closest_hook_names, hook_hint
from .names import ALIASES, BLOCK_SHORT, NORM_SHORT, TOP_SHORT, get_act_name, head_label, hook_name
from .resid import LATE_WRITES, Part, headless, need, pinned_norm, post_normed, resid_parts
from .slices import PosSlice, Slice, apply_slice, as_int
from .stream import Stream, as_stream, check_layer

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ActivationCache", "CacheKeyError", "hook_name"]

Stacked = Union[torch.Tensor, tuple[torch.Tensor, list[str]]]  # a stack, or (stack, labels) with return_labels

KEY_FORMS = ("a hook name such as 'blocks.3.attn.hook_q', a short name such as 'embed' or 'q3', "
             "(short name, layer) such as ('resid_post', 3), (short name, layer, norm) such as ('scale', 3, 'ln1'), "
             "or a lenskit.Stream")


class CacheKeyError(KeyError, TypeError):
    """A cache key of a form the cache does not take (42, None, ("resid_post",)): a KeyError, so `key in cache`
    and `cache.get(key)` treat it as absent, and a TypeError, as Python does for a key of the wrong kind."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ActivationCache(Mapping):
    """Activations keyed by hook name, plus `cache["resid_post", 3]` shorthand and TransformerLens's
    helpers: the stacks of the stream (`accumulated_resid`, `decompose_resid`, `apply_ln_to_stack`, `logit_attrs`,
    `get_full_resid_decomposition`) and of heads and neurons (`stack_head_results`, `stack_neuron_results`).

    Built as lenskit does, `ActivationCache(cache_dict, n_layers, model=None)`, or in TransformerLens's order,
    `ActivationCache(cache_dict, model, has_batch_dim=True)`. Tensors are stored as produced (detached, never
    copied) unless a device or dtype was requested. `model` (set by `run_with_cache`) gives the helpers the
    model's norms and weights; a cache built without one still reads and stacks, but cannot apply a norm.
    """

    def __init__(self, cache_dict: dict[str, torch.Tensor], n_layers: "int | nn.Module | None" = None,
                 model: "nn.Module | None" = None, has_batch_dim: bool = True) -> None:
        if n_layers is not None and as_int(n_layers) is None:  # TransformerLens's order: (cache_dict, model)
            if model is not None:
                raise TypeError("ActivationCache(cache_dict, n_layers, model) or ActivationCache(cache_dict, model): "
                                f"got a {type(n_layers).__name__} for n_layers and a model as well; pass the model once")
            n_layers, model = None, n_layers
        if n_layers is None:
            if model is None:
                raise TypeError("ActivationCache needs n_layers or the model: ActivationCache(cache_dict, n_layers) "
                                "or ActivationCache(cache_dict, model)")
            if not hasattr(getattr(model, "cfg", None), "n_layers"):
                raise TypeError(f"ActivationCache's second argument is n_layers (an int) or the model (with cfg.n_layers), "
                                f"got {type(model).__name__} {model!r:.40}")
            n_layers = model.cfg.n_layers
        self._store = cache_dict
        self.n_layers = as_int(n_layers)
        self.model = model
        self.has_batch_dim = has_batch_dim

    @property
    def cache_dict(self) -> dict[str, torch.Tensor]:
        """The dict behind the cache, hook name -> tensor, as TransformerLens exposes it (the same dict, not a copy)."""
        return self._store

    def __getitem__(self, key: str | tuple | Stream) -> torch.Tensor:
        if isinstance(key, Stream):
            return self.stream(key)
        name = self._name(key)
        try:
            return self._store[name]
        except KeyError:
            close = closest_hook_names(name, self._store)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"{name!r} is not in this cache ({len(self._store)} entries){hint}") from None

    def _name(self, key: str | tuple) -> str:
        """A hook name from a key: a name, TransformerLens shorthand ("embed", "k6"), (short, layer[, layer_type]).

        A layer is an int (negative counts back from n_layers), a 0-d integer tensor, or None for the hooks outside
        the blocks (`cache["embed", None]`, `cache["scale", None]` is the final norm's)."""
        if isinstance(key, tuple):
            if len(key) not in (2, 3):
                raise CacheKeyError(f"a cache key tuple has 2 or 3 parts, got {len(key)}: {key!r:.80}; pass {KEY_FORMS}")
            short, layer, layer_type = (*key, None)[:3]
            if layer is None:
                return get_act_name(short, None, layer_type)
            index = as_int(layer)
            layer = check_layer(layer if index is None else index, self.n_layers)
            if len(key) == 3 or ALIASES.get(short, short) in (*NORM_SHORT, *TOP_SHORT):
                return get_act_name(short, layer, layer_type)
            if ALIASES.get(short, short) not in BLOCK_SHORT:  # this cache's names, closest first, not every family's
                raise KeyError(f"unknown short hook name {short!r}{hook_hint(f'{short}.{layer}', self._store)}")
            return hook_name(ALIASES.get(short, short), layer, self.n_layers)
        if not isinstance(key, str):
            hint = "; cache.stream(l) reads the stream after l blocks" if type(key) is int else ""
            raise CacheKeyError(f"cache keys are hook names, got {type(key).__name__} {key!r:.60}{hint}; pass {KEY_FORMS}")
        if key not in self._store:
            try:
                return get_act_name(key)
            except (KeyError, ValueError):
                return key
        return key

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except (KeyError, IndexError, ValueError, TypeError):  # an out-of-range layer or a non-key is simply not here
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} tensors, n_layers={self.n_layers})"

    def stream(self, s: int | str | Stream) -> torch.Tensor:
        """The stream at `s` [batch, pos, d_model]: `cache.stream(3)` is the stream after 3 blocks,
        `cache.stream(Stream(3, "resid_mid"))` or `cache.stream("resid_mid.3")` the middle of block 3."""
        return self[as_stream(s).hook_name(self.n_layers)]

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "ActivationCache":
        """A new cache with every tensor moved and/or cast (TransformerLens moves its own in place; use the result)."""
        return ActivationCache({k: v.to(device=device, dtype=dtype) for k, v in self._store.items()}, self.n_layers,
                               self.model, has_batch_dim=self.has_batch_dim)

    def remove_batch_dim(self, batch_size: int | None = None) -> "ActivationCache":
        """Drop the batch axis of a one-sequence cache, in place (as TransformerLens does), and return it.
        `batch_size`, where given, is checked to be 1. On a cache whose axis is already gone it warns and does
        nothing, as TransformerLens does, so calling it twice cannot drop a second axis."""
        if not self.has_batch_dim:
            warnings.warn("this cache's batch axis is already removed; remove_batch_dim did nothing", stacklevel=2)
            return self
        sizes = {v.shape[0] for v in self._store.values() if v.ndim > 0}
        if sizes - {1} or batch_size not in (None, 1):
            raise ValueError(f"remove_batch_dim needs a cache of one sequence, this one has batch size "
                             f"{max(sizes | {batch_size or 1})}; index the sequence you want first, e.g. run_with_cache(tokens[:1])")
        for name, v in self._store.items():
            self._store[name] = v[0]
        self.has_batch_dim = False
        return self

    def apply_slice_to_batch_dim(self, batch_slice: PosSlice) -> "ActivationCache":
        """A new cache of the sequences `batch_slice` selects (see `Slice`); an int drops the batch axis."""
        batch_slice = Slice(batch_slice)
        if not self.has_batch_dim and batch_slice.mode != "identity":
            raise ValueError("this cache has no batch axis (remove_batch_dim ran), so there is no sequence to select")
        return ActivationCache({k: batch_slice.apply(v, 0) if v.ndim > 0 else v for k, v in self._store.items()},
                               self.n_layers, self.model, has_batch_dim=self.has_batch_dim and batch_slice.mode != "int")

    def toggle_autodiff(self, mode: bool = False) -> None:
        """`torch.set_grad_enabled(mode)`, as TransformerLens's cache offers it: global state, for every later call
        in this thread; `with torch.no_grad():` is the local form."""
        warnings.warn(f"toggle_autodiff changes torch's global state: gradients are now {'on' if mode else 'off'}",
                      stacklevel=2)
        torch.set_grad_enabled(mode)

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: str | None = None) -> torch.Tensor:
        """`cache[activation_name, l, sublayer_type]` for every block l < `layer` (None or -1: all blocks),
        stacked: [layer, *activation shape]."""
        layer = self.n_layers if layer is None or layer == -1 else layer
        return torch.stack([self[activation_name, l, sublayer_type] for l in range(check_layer(layer, self.n_layers, final=True))])

    # ================================================================== stacks of the residual stream

    # ------------------------------------------------------------------ shared by the stacks
    def _upto(self, layer: int | None, what: str) -> int:
        """TransformerLens's `layer` for stacks: the input of block `layer`, 0..n_layers; None or -1 = all of them."""
        n = self.n_layers
        layer = layer if as_int(layer) is None else as_int(layer)
        if layer is None or layer == -1:
            return n
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
            raise ValueError(f"{what}: layer must be 0..{n} (the input of that block; {n} = the final stream) "
                             f"or None / -1 for all, got {layer!r}")
        return layer

    def _stack(self, parts: list[torch.Tensor], pos_slice: PosSlice, pos_dim: int) -> torch.Tensor:
        """[component, ...] from tensors with positions at `pos_dim`; an empty stack keeps the embedding's shape."""
        if not parts:
            like = self._like(pos_slice)
            return like.new_zeros(0, *like.shape)
        return torch.stack([apply_slice(t, pos_slice, pos_dim) for t in parts])

    def _like(self, pos_slice: PosSlice) -> torch.Tensor:
        """The token embedding with `pos_slice` applied: the shape [batch, pos, d_model] of one stack entry."""
        return apply_slice(need(self, "hook_embed", "an empty stack"), pos_slice, -2)

    def _norm(self, layer: int, mlp_input: bool, what: str) -> "nn.Module":
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
    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False,
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

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
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

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None,
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

    def logit_attrs(self, residual_stack: torch.Tensor, tokens: "str | int | torch.Tensor",
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

    def get_full_resid_decomposition(self, layer: int | None = None, mlp_input: bool = False,
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

    def _output_bias(self, layer: int, mlp_input: bool, mlp_biases: bool) -> torch.Tensor:
        """The output biases that reach the input of block `layer` (its MLP's with `mlp_input`): every earlier
        attention's `b_O` (block `layer`'s too with `mlp_input`) and, with `mlp_biases`, every earlier MLP's `b_out`
        [d_model]. Heads' and neurons' writes leave them out."""
        if self.model is None:
            raise ValueError("get_full_resid_decomposition needs the model's biases, and this cache was built without a "
                             "model; get the cache from model.run_with_cache, or pass ActivationCache(cache_dict, model)")
        return self.model.accumulated_bias(layer, mlp_input, mlp_biases).detach()  # [d_model]

    # ================================================================== single heads and neurons

    def _model(self, what: str) -> "nn.Module":
        if self.model is None:
            raise ValueError(f"{what} needs the model's weights, and this cache was built without a model; "
                             "get the cache from model.run_with_cache, or pass ActivationCache(cache_dict, model)")
        return self.model

    # ------------------------------------------------------------------ heads
    def _reaching_heads(self, layer: int, what: str) -> None:
        """Refuse block `layer` where its heads' writes are not what reaches the stream."""
        if post_normed(self, layer):
            raise ValueError(f"{what}: block {layer} normalises attention's output (ln1_post) after its heads are "
                             "summed, so the heads' writes do not add up to what reaches the stream; use "
                             "decompose_resid for whole-layer writes")
        if kind := headless(self, layer):
            raise ValueError(f"{what}: block {layer} is a {kind} layer, which has no heads' writes; use "
                             "decompose_resid for whole-layer writes")

    def _head_result(self, layer: int, what: str) -> torch.Tensor:
        """Block `layer`'s `attn.hook_result` [batch, pos, head, d_model], computed from its z and W_O and kept in
        the cache where the run did not record it."""
        name = hook_name("result", layer)
        if name not in self._store:
            z = need(self, hook_name("z", layer), what)  # [batch, pos, head, d_head]
            W_O = self._model(what).blocks[layer].attn.W_O.detach().to(z.device)  # [head, d_head, d_model]
            dtype = torch.promote_types(z.dtype, W_O.dtype)
            self._store[name] = torch.einsum("...hd,hdm->...hm", z.to(dtype), W_O.to(dtype))
        return self._store[name]

    def compute_head_results(self) -> None:
        """Add every attention block's `attn.hook_result` [batch, pos, head, d_model] that the run did not record,
        from its cached z and the model's W_O, as the model's own hook computes it (summed over heads, plus b_O, it
        is the attention's output). Blocks without heads (linear attention) have none and are skipped."""
        for layer in range(self.n_layers):
            if not headless(self, layer):
                self._head_result(layer, "compute_head_results")

    def stack_head_results(self, layer: int = -1, return_labels: bool = False,
                           incl_remainder: bool = False, pos_slice: PosSlice = None, apply_ln: bool = False) -> Stacked:
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
    def _neurons(self, layer: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `layer`'s neuron activations [batch, pos, d_mlp] and W_out [d_mlp, d_model], on the same device."""
        model = self._model(what)
        if not model.cfg.has_mlp(layer):
            raise ValueError(f"{what}: block {layer} has no MLP (a {model.cfg.layer_type(layer)} block; Nemotron-H's blocks "
                             f"hold one sublayer each), so it has no neurons; use the blocks with an MLP "
                             f"({[l for l in range(model.cfg.n_layers) if model.cfg.has_mlp(l)]}) or decompose_resid")
        if model.cfg.is_moe_layer(layer):
            raise ValueError(f"{what}: block {layer} is a mixture of experts, whose neurons are each expert's and "
                             "change with the routing; use decompose_resid (or expand_neurons=False) for its whole write")
        if post_normed(self, layer, "ln2_post"):
            raise ValueError(f"{what}: block {layer} normalises its MLP's output (ln2_post) after the neurons are "
                             "summed, so the neurons' writes do not add up to what reaches the stream; use "
                             "decompose_resid (or expand_neurons=False) for whole-layer writes")
        post = need(self, hook_name("post", layer), what)  # [batch, pos, d_mlp]
        return post, model.blocks[layer].mlp.W_out.detach().to(post.device)

    def get_neuron_results(self, layer: int, neuron_slice: PosSlice = None,
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

    def stack_neuron_results(self, layer: int, pos_slice: PosSlice = None,
                             neuron_slice: PosSlice = None, return_labels: bool = False, incl_remainder: bool = False,
                             apply_ln: bool = False, project_output_onto: torch.Tensor | None = None,
                             mlp_input: bool = False) -> Stacked:
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

    def _neurons_through_norm(self, l: int, layer: int, mlp_input: bool, neuron_slice: Slice,
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


def residual_directions(model: "nn.Module | None", tokens: "str | int | torch.Tensor") -> torch.Tensor:
    """The unembedding columns of `tokens`, the directions the model reads each token's logit from: [d_model] for
    one token (text of one token, an id, a tensor of one id), else [*tokens.shape, d_model]."""
    if model is None:
        raise ValueError("logit_attrs needs the model's unembedding, and this cache was built without a model; "
                         "get the cache from model.run_with_cache, or pass ActivationCache(cache_dict, model)")
    return model.tokens_to_residual_directions(tokens).detach()  # [d_model] or [*tokens.shape, d_model]

"""ActivationCache: a read-only mapping from hook names to the tensors a forward pass produced."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Iterator

import torch

from .names import get_act_name, hook_name
from .resid import LATE_WRITES, Part, PosSlice, apply_slice, headless, need, pinned_norm, post_normed, resid_parts
from .stream import Stream, as_stream, check_layer

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ActivationCache", "CacheKeyError", "hook_name"]

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
    stacking helpers (`accumulated_resid`, `decompose_resid`, `stack_head_results`, `apply_ln_to_stack`).

    Tensors are stored as produced (detached, never copied) unless a device or dtype was requested.
    `model` (set by `run_with_cache`) gives the helpers the model's norms; a cache built without one
    still reads and stacks, but cannot apply a norm.
    """

    def __init__(self, store: dict[str, torch.Tensor], n_layers: int, model: "nn.Module | None" = None) -> None:
        self._store = store
        self.n_layers = n_layers
        self.model = model
        self.has_batch_dim = True

    def __getitem__(self, key: str | tuple | Stream) -> torch.Tensor:
        if isinstance(key, Stream):
            return self.stream(key)
        name = self._name(key)
        try:
            return self._store[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._store), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"{name!r} is not in this cache ({len(self._store)} entries){hint}") from None

    def _name(self, key: str | tuple) -> str:
        """A hook name from a key: a name, TransformerLens shorthand ("embed", "k6"), (short, layer[, layer_type])."""
        if isinstance(key, tuple):
            if len(key) == 3:
                return get_act_name(key[0], check_layer(key[1], self.n_layers), key[2])
            if len(key) == 2:
                return hook_name(key[0], key[1], self.n_layers)
            raise CacheKeyError(f"a cache key tuple has 2 or 3 parts, got {len(key)}: {key!r:.80}; pass {KEY_FORMS}")
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
        """A new cache with every tensor moved and/or cast."""
        moved = ActivationCache({k: v.to(device=device, dtype=dtype) for k, v in self._store.items()}, self.n_layers, self.model)
        moved.has_batch_dim = self.has_batch_dim
        return moved

    def remove_batch_dim(self) -> "ActivationCache":
        """Drop the batch axis of a one-sequence cache, in place (as TransformerLens does), and return it."""
        if not self.has_batch_dim:
            raise ValueError("this cache's batch axis is already removed")
        sizes = {v.shape[0] for v in self._store.values() if v.ndim > 0}
        if sizes - {1}:
            raise ValueError(f"remove_batch_dim needs a cache of one sequence, this one has batch size {max(sizes)}; "
                             "index the sequence you want first, e.g. run_with_cache(tokens[:1])")
        for name, v in self._store.items():
            self._store[name] = v[0]
        self.has_batch_dim = False
        return self

    # ---------------------------------------------------- TransformerLens stacks
    def _upto(self, layer: int | None, what: str) -> int:
        """TransformerLens's `layer` for stacks: the input of block `layer`, 0..n_layers; None or -1 = all of them."""
        n = self.n_layers
        if layer is None or layer == -1:
            return n
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
            raise ValueError(f"{what}: layer must be 0..{n} (the input of that block; {n} = the final stream) "
                             f"or None / -1 for all, got {layer!r}")
        return layer

    def _stack(self, parts: list[torch.Tensor], pos_slice: PosSlice, pos_dim: int) -> torch.Tensor:
        """[component, ...] from tensors with positions at `pos_dim`; an empty stack keeps the embedding's shape."""
        if not parts:
            like = apply_slice(self["hook_embed"], pos_slice, -2)
            return like.new_zeros(0, *like.shape)
        return torch.stack([apply_slice(t, pos_slice, pos_dim) for t in parts])

    def _norm(self, layer: int, mlp_input: bool, what: str) -> "nn.Module":
        if self.model is None:
            raise ValueError(f"{what} needs the model's norms, and this cache was built without a model; "
                             "get the cache from model.run_with_cache, or pass ActivationCache(store, n_layers, model)")
        if layer == self.n_layers:
            if mlp_input:
                raise ValueError("mlp_input=True names block `layer`'s MLP input; the final stream (layer = n_layers) has none")
            return self.model.ln_final
        return self.model.blocks[layer].ln2 if mlp_input else self.model.blocks[layer].ln1

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: PosSlice = None, mlp_input: bool = False, return_labels: bool = False,
                          ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """The residual stream after 0..layer blocks, stacked: [layer + 1, batch, pos, d_model].

        Index l is `resid_pre` of block l (label "l_pre"); with the default layer (None or -1) the last entry
        is the final block's `resid_post` ("final_post"). `incl_mid` interleaves each earlier block's
        `resid_mid` ("l_mid"); `mlp_input` appends block `layer`'s `resid_mid`. `pos_slice` selects positions.

        `apply_ln=True` puts every stream through the model's final norm, its scale computed from that
        stream (the logit lens: `model.unembed(stack)` gives each stream's logits), whatever `layer` is.
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
            stack = self._norm(self.n_layers, False, "accumulated_resid(apply_ln=True)")(stack)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all", apply_ln: bool = False,
                        pos_slice: PosSlice = None, incl_embeds: bool = True, return_labels: bool = False,
                        ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
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

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: PosSlice = None, apply_ln: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """Every head's write to the stream in blocks before `layer`: [layer * head, batch, pos, d_model],
        labels "L0H0", "L0H1", ... `incl_remainder` adds the rest of the stream at the input of `layer`
        (embeddings, MLPs, biases), so the stack sums to it. Needs `attn.hook_result`, computed on request:
        `model.run_with_cache(tokens, names_filter=lambda name: True)`.

        Refused for a model that normalises attention's output before adding it (Gemma 2/3, OLMo 2: `ln1_post`),
        whose heads' writes do not add up to what reaches the stream.
        """
        layer = self._upto(layer, "stack_head_results")
        heads, labels = [], []
        for l in range(layer):
            if post_normed(self, l):
                raise ValueError(f"stack_head_results: block {l} normalises attention's output (ln1_post) after its "
                                 "heads are summed, so the heads' writes do not add up to what reaches the stream; "
                                 "use decompose_resid for whole-layer writes")
            if kind := headless(self, l):
                raise ValueError(f"stack_head_results: block {l} is a {kind} layer, which has no heads' writes; use "
                                 "decompose_resid for whole-layer writes")
            result = need(self, hook_name("result", l), "stack_head_results")  # [..., pos, head, d_model]
            heads += list(result.movedim(-2, 0))
            labels += [f"L{l}H{h}" for h in range(result.shape[-2])]
        stack = self._stack(heads, pos_slice, -2)
        if incl_remainder:
            total = apply_slice(need(self, Stream(layer).hook_name(self.n_layers), "stack_head_results"), pos_slice, -2)
            stack = torch.cat([stack, (total - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice: PosSlice = None, batch_slice: PosSlice = None, has_batch_dim: bool = True) -> torch.Tensor:
        """Each component of `residual_stack` [component, batch, pos, d_model] through the norm that reads the
        input of block `layer` (ln1, or ln2 with `mlp_input`; the final norm for layer n_layers / None / -1),
        with the scale the whole stream gave that norm (its cached `hook_scale`), without the norm's bias.

        The components of a decomposition then sum to the norm's output less its bias. Unlike
        TransformerLens, whose default model has the norm's gain folded into the next weights, lenskit
        keeps raw weights, so the gain is applied here. `pos_slice` and `batch_slice` say which positions
        and sequences the stack holds (already applied to it; `batch_slice` is applied to the stack too).
        """
        layer = self._upto(layer, "apply_ln_to_stack")
        norm = self._norm(layer, mlp_input, "apply_ln_to_stack")
        scale = apply_slice(need(self, norm.hook_scale.name, "apply_ln_to_stack"), pos_slice, -2)  # [batch, pos, 1]
        if batch_slice is not None:
            if has_batch_dim:
                residual_stack = apply_slice(residual_stack, batch_slice, 1)
            if self.has_batch_dim:
                scale = apply_slice(scale, batch_slice, 0)
        return pinned_norm(norm, residual_stack, scale, self.model)

"""ActivationCache: a mapping from hook names to the tensors a forward pass produced, read-only to item assignment;
the one thing added later is the heads' writes, `attn.hook_result`, computed from z where a stack needs them (as
TransformerLens does, `compute_head_results`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Iterator

import torch

from ..suggest import closest_hook_names, hook_hint
from .cache_components import ComponentStacks
from .cache_resid import ResidStacks
from .names import ALIASES, BLOCK_SHORT, NORM_SHORT, TOP_SHORT, get_act_name, hook_name
from .slices import PosSlice, Slice, as_int
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


class ActivationCache(ResidStacks, ComponentStacks, Mapping):
    """Activations keyed by hook name, plus `cache["resid_post", 3]` shorthand and TransformerLens's
    helpers: the stacks of the stream (`accumulated_resid`, `decompose_resid`, `apply_ln_to_stack`, `logit_attrs`,
    `get_full_resid_decomposition`, in `cache_resid`) and of heads and neurons (`cache_components`).

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


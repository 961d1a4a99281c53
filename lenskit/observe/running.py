"""Running a hooked model: with hooks for one call (`run_with_hooks`), with a cache of activations
(`run_with_cache`), with SAEs spliced in (`saes`, `run_with_saes`; lenskit.saes.splice). Mixed into `lenskit.HookedTransformer`, which gives them `cfg`, `blocks`, `hook_dict` and its
forward; `add_hook` and the rest of TransformerLens's hook administration are in lenskit.observe.hooks (HookedRootModule)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Sequence

import torch

from ..devices import parse_device
from .backward import backward_from, check_gradients_possible
from .cache import ActivationCache
from .hooks import CacheRecording, HookFn, NameOrPredicate, NamesFilter, layer_of

if TYPE_CHECKING:
    from ..model import TokensLike


class RunMethods:
    """`run_with_hooks`, `run_with_cache`, `saes` and `run_with_saes` for `HookedTransformer`."""

    def run_with_hooks(self, tokens: TokensLike, fwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (),
                       bwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (), *, reset_hooks_end: bool = True,
                       clear_contexts: bool = False, **kwargs: Any) -> torch.Tensor:
        """Run with hooks attached for this call only; they are removed even if the call raises.

        Backward hooks removed on return never see a gradient, so `bwd_hooks` need `reset_hooks_end=False`, as in
        TransformerLens: then all the hooks are attached globally and stay until `reset_hooks()`. Within one thread,
        `with model.hooks(fwd_hooks, bwd_hooks): model(tokens, return_type="loss").backward()` is the temporary form.
        """
        if not reset_hooks_end:
            for dir, pairs in (("fwd", list(fwd_hooks)), ("bwd", list(bwd_hooks))):
                self._pairs(pairs, f"{dir}_hooks")  # refuse a bad pair before attaching any
                for target, fn in pairs:
                    self.add_hook(target, fn, dir=dir)
            return self(tokens, **kwargs)
        bwd_hooks = list(bwd_hooks)
        if bwd_hooks:
            warnings.warn("run_with_hooks removes its hooks when it returns, before any backward pass can run, so "
                          "bwd_hooks will not be called; pass reset_hooks_end=False (and call reset_hooks() after), "
                          "or call .backward() inside `with model.hooks(fwd_hooks, bwd_hooks):`", stacklevel=2)
        with self.hooks(fwd_hooks, bwd_hooks, clear_contexts=clear_contexts):
            return self(tokens, **kwargs)

    def saes(self, saes: Sequence[Any], use_error_term: bool = True) -> ContextManager[Any]:
        """Splice SAEs (lenskit.saes.SAE) in for the body of a `with` block; removed on exit, also when it raises.

        With `use_error_term` (the default) each hook gets reconstruction + error, so outputs are unchanged to
        rounding while the SAE's own hook points (`f"{hook}.hook_sae_acts_post"`, ...) are in `hook_dict`, cached
        and hookable; without it the activation is replaced by the reconstruction. See lenskit.saes.splice.
        """
        from ..saes.splice import spliced

        return spliced(self, saes, use_error_term)

    def run_with_saes(self, tokens: TokensLike, saes: Sequence[Any] = (), *, use_error_term: bool = True,
                      **kwargs: Any) -> torch.Tensor:
        """Run once with `saes` spliced in (`model.saes`); `use_error_term=False` runs on the reconstructions."""
        with self.saes(saes, use_error_term=use_error_term):
            return self(tokens, **kwargs)

    def run_with_cache(
        self,
        tokens: TokensLike,
        names_filter: NamesFilter = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        fwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (),
        return_logits: bool = True,
        cache_device: str | torch.device | None = None,
        incl_bwd: bool = False,
        remove_batch_dim: bool = False,
        return_cache_object: bool = True,
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor | None, ActivationCache | dict[str, torch.Tensor]]:
        """Run once and keep the activations `names_filter` selects (see `hook_names`).

        Cached tensors are stored as produced, without copies, unless `device` or `dtype` asks for one.
        `cache_device="cpu"` (or `device`, TransformerLens's name for it) offloads: each tensor leaves the
        accelerator as it is written, through pinned memory without waiting, with one wait at the end, so a
        long cache needs no accelerator memory. On the CPU it is the plain cache.
        `fwd_hooks` run before caching, so the cache sees their edits. An edit in place never reaches an
        entry cached at an earlier point (`resid_post` of block l is the same tensor as `resid_pre` of block
        l + 1): a hook handed a tensor the cache already holds gets a copy (see `CacheRecording`).

        With `return_logits=False` the run stops after the last block that a cached name or a `fwd_hooks`
        target lives in, skipping the unembedding, and returns `(None, cache)`:

        >>> _, cache = model.run_with_cache(tokens, ["blocks.2.hook_resid_post"], return_logits=False)  # 3 blocks run

        `incl_bwd=True` does as TransformerLens does: it calls `.backward()` on the output, which must then be a
        scalar (`return_type="loss"`), and caches the gradient reaching each cached point under `<name>_grad`.
        Parameter gradients accumulate into `.grad` as in any backward pass.

        `remove_batch_dim=True` drops the batch axis of a one-sequence run's cache (`cache.remove_batch_dim()`); the
        logits keep theirs, as in TransformerLens. `return_cache_object=False` returns the plain dict of tensors
        (`cache.cache_dict`) instead of the cache. `clear_contexts=True` empties every hook point's `ctx` at the end.
        `reset_hooks_end` (TransformerLens's) may only be True: the caching hooks are always removed on return.
        """
        if reset_hooks_end is not True:
            raise ValueError("run_with_cache always removes its hooks on return (reset_hooks_end=True); for gradients "
                             "at the cached points pass incl_bwd=True, or attach hooks with model.add_hook")
        if incl_bwd:
            check_gradients_possible("run_with_cache(incl_bwd=True)")
        if incl_bwd and not return_logits:
            raise ValueError("incl_bwd=True differentiates the model's output, so the run cannot stop early; "
                             "drop return_logits=False")
        if cache_device is not None and device is not None and torch.device(cache_device) != torch.device(device):
            raise ValueError(f"device={device!r} and cache_device={cache_device!r} both say where the cache goes; pass one")
        where = cache_device if cache_device is not None else device
        if where is not None:  # an impossible device refused in one line, before the run
            parse_device(where, "cache_device" if cache_device is not None else "device")
        recording = CacheRecording(where, dtype)
        names = self.hook_names(names_filter)
        fwd_hooks = list(fwd_hooks)
        stop = kwargs.get("stop_at_layer")
        if not return_logits:
            if stop is not None:
                raise ValueError("pass return_logits=False or stop_at_layer, not both: return_logits=False "
                                 "already stops after the last block that the cache or fwd_hooks need")
            targets = [n for item in fwd_hooks if isinstance(item, (tuple, list)) for n in self._names_of(item[0])]
            kwargs["stop_at_layer"] = self._blocks_needed([*names, *targets])
        elif isinstance(stop, int) and isinstance(names_filter, (str, list, tuple)):
            # Names asked for one by one must all arrive; a predicate takes what the shortened run has.
            stop = stop if stop >= 0 else self.cfg.n_layers + stop
            late = [n for n in names if (need := self._blocks_needed([n])) is None or need > stop]
            if late:
                raise ValueError(f"stop_at_layer={kwargs['stop_at_layer']} ends the run before {late[:3]} fire; "
                                 "drop those names, raise stop_at_layer, or use return_logits=False")
        grads = CacheRecording(cache_device if cache_device is not None else device, dtype)
        bwd_hooks = [(name, grads.hook) for name in names] if incl_bwd else []
        try:
            with self.hooks([*fwd_hooks, *((name, recording.hook) for name in names)], bwd_hooks):
                with recording.recording():
                    out = self(tokens, **kwargs)
                if incl_bwd:
                    backward_from(out, " (return_type='loss', outside torch.no_grad())")
        finally:
            recording.synchronise()  # offloaded entries hold their values from here on
            grads.synchronise()
            if clear_contexts:
                self.clear_contexts()
        recording.check_unchanged()
        store = {**recording.store, **{f"{name}_grad": g for name, g in grads.store.items()}}
        cache = ActivationCache(store, self.cfg.n_layers, self)
        cache = cache.remove_batch_dim() if remove_batch_dim else cache
        return (out if return_logits else None), (cache if return_cache_object else cache.cache_dict)

    def _unknown(self, name: str) -> KeyError:
        """An unknown hook name; one that a block's kind of token mixer lacks (a linear-attention block's
        `attn.hook_pattern`) names the block's kind."""
        layer = layer_of(name)
        if layer is not None and layer < len(self.blocks):
            attn = self.blocks[layer].attn
            if name.removeprefix(f"blocks.{layer}.attn.") in getattr(attn, "NO_HOOKS", ()):
                return KeyError(f"{name}: block {layer} is a {attn.LAYER_TYPE} layer, which has no attention scores, "
                                f"pattern, rotary or per-head results; use its attn.hook_q/k/v, hook_beta, hook_g, hook_z "
                                f"or hook_state, or a block whose layer type is 'full' ({self.cfg.layer_types})")
        return super()._unknown(name)

    def _names_of(self, target: NameOrPredicate) -> list[str]:
        if isinstance(target, str):
            return [target]
        return [n for n in self.hook_dict if target(n)] if callable(target) else []

    def _blocks_needed(self, names: Iterable[str]) -> int | None:
        """How many blocks must run for every hook in `names` to fire; None when one is past the blocks."""
        needed = 0
        for name in names:
            layer = layer_of(name)
            if layer is None and name not in ("hook_embed", "hook_pos_embed"):
                return None  # ln_final and anything else after the blocks: the whole model runs
            needed = max(needed, 0 if layer is None else layer + 1)
        return needed

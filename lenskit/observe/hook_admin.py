"""TransformerLens's hook administration on any `HookedRootModule`, so code written against
`transformer_lens.hook_points.HookedRootModule` (an SAE that builds HookPoints, calls `self.setup()`, then
`run_with_hooks` / `run_with_cache`) runs on lenskit's.

Global hooks (`add_hook`, `add_perma_hook`) are seen by every thread until removed; permanent ones survive
`reset_hooks()` unless it is passed `including_permanent=True`. `run_with_hooks` and `run_with_cache` here are the
generic forms: they pass every positional and keyword argument to the module's forward. `lenskit.HookedTransformer`
has its own richer ones (lenskit.model), with the same hook semantics.

>>> class Doubler(HookedRootModule):
...     def __init__(self):
...         super().__init__()
...         self.hook_in = HookPoint()    # [batch, d]
...         self.setup()
...     def forward(self, x):
...         return 2 * self.hook_in(x)
>>> out, cache = Doubler().run_with_cache(torch.ones(1, 3))   # cache: {"hook_in": tensor [1, 3]}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from .backward import backward_from

if TYPE_CHECKING:
    from .hooks import HookFn, HookPoint, NameOrPredicate, NamesFilter

HookPairs = Iterable["tuple[NameOrPredicate, HookFn]"]


class HookAdmin:
    """Mixin for `HookedRootModule` (which gives it `hook_dict`, `hooks()`, `hook_names()`, `_resolve()`)."""

    hook_dict: "dict[str, HookPoint]"

    def hook_points(self) -> "Iterable[HookPoint]":
        """Every hook point, in module order."""
        return self.hook_dict.values()

    def add_hook(self, name: "NameOrPredicate", hook: "HookFn", dir: str = "fwd", is_permanent: bool = False,
                 level: int | None = None, prepend: bool = False) -> None:
        """Attach `hook` to a hook point (or every point a predicate on names selects) GLOBALLY: every thread and
        every later call sees it until `reset_hooks()` (or, with `is_permanent`, `reset_hooks(including_permanent=True)`).
        `dir="bwd"` attaches a backward hook (`lenskit.observe.backward`); `prepend` runs it before the hooks already
        there. Prefer `hooks(...)` / `run_with_hooks`, which are temporary and belong to the calling thread."""
        if not callable(hook):
            raise TypeError(f"hook for {name!r} is not callable: {hook!r}")
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        points = self._resolve(name)
        if dir == "bwd" and not isinstance(name, str):  # a predicate passes over integer points (no gradient there)
            points = [hp for hp in points if not hp.integer]
        for hp in points:
            hp.add_hook(hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def add_perma_hook(self, name: "NameOrPredicate", hook: "HookFn", dir: str = "fwd") -> None:
        """`add_hook(name, hook, dir, is_permanent=True)`."""
        self.add_hook(name, hook, dir=dir, is_permanent=True)

    def run_with_hooks(self, *model_args: Any, fwd_hooks: HookPairs = (), bwd_hooks: HookPairs = (),
                       reset_hooks_end: bool = True, clear_contexts: bool = False, **model_kwargs: Any) -> Any:
        """The forward on `model_args` / `model_kwargs` with the hooks attached for this call (with
        `reset_hooks_end=False`, attached globally and left there, which backward hooks need: they run only when
        `.backward()` is called after the forward)."""
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
            return self(*model_args, **model_kwargs)

    def run_with_cache(self, *model_args: Any, names_filter: "NamesFilter" = None, device: str | torch.device | None = None,
                       remove_batch_dim: bool = False, incl_bwd: bool = False, reset_hooks_end: bool = True,
                       clear_contexts: bool = False, **model_kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        """(the forward's output, {hook name: activation}) for the points `names_filter` selects (None: all; a name;
        a list of names; a predicate). Activations are detached, moved to `device` where given, and with
        `remove_batch_dim` lose a leading axis of size 1. `incl_bwd=True` calls `.backward()` on the output (a scalar)
        and keeps the gradient reaching each point under `<name>_grad`."""
        if remove_batch_dim and model_args and isinstance(model_args[0], torch.Tensor) and model_args[0].ndim > 0 \
                and model_args[0].shape[0] != 1:
            raise ValueError(f"remove_batch_dim=True needs a batch of 1; the input's first axis is "
                             f"{model_args[0].shape[0]}: run one example, or drop remove_batch_dim")
        cache, fwd, bwd = self.get_caching_hooks(names_filter, incl_bwd, device, remove_batch_dim)
        with self.hooks(fwd, bwd, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
            out = self(*model_args, **model_kwargs)
            if incl_bwd:
                backward_from(out)
        return out, cache

    def get_caching_hooks(self, names_filter: "NamesFilter" = None, incl_bwd: bool = False,
                          device: str | torch.device | None = None, remove_batch_dim: bool = False,
                          cache: dict | None = None) -> tuple[dict, list, list]:
        """(cache, fwd_hooks, bwd_hooks): hooks that write into `cache` (a new dict unless given), not attached."""
        cache = {} if cache is None else cache

        def keeper(suffix: str) -> Callable[[torch.Tensor, "HookPoint"], None]:
            def keep(x: torch.Tensor, hook: "HookPoint") -> None:
                x = x.detach().to(device)
                cache[hook.name + suffix] = x.squeeze(0) if remove_batch_dim and x.ndim > 0 and x.shape[0] == 1 else x
            return keep

        names = self.hook_names(names_filter)
        fwd = [(name, keeper("")) for name in names]
        bwd = [(name, keeper("_grad")) for name in names] if incl_bwd else []
        return cache, fwd, bwd


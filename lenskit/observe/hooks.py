"""Hook points: identity modules that name a tensor in the forward pass and let callers read or edit it.

Names come from the module tree (`blocks.3.hook_resid_post`), so nobody types a name twice.
Hooks are temporary: `HookedRootModule.hooks()` removes everything it added in a `finally`.

Hooks added through `hooks()`, `run_with_hooks` or `run_with_cache` belong to the calling thread (its
`contextvars` context): two threads running one model never see each other's hooks. `HookPoint.add_hook`
attaches a global hook instead, seen by every thread until it is removed or `reset_hooks()` runs.
"""

from __future__ import annotations

import difflib
import re
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterable, Iterator, Sequence, Union

import torch
from torch import nn

HookFn = Callable[[torch.Tensor, "HookPoint"], Union[torch.Tensor, None]]
NameOrPredicate = Union[str, Callable[[str], bool]]
NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


# The hooks of the current thread/context: hook point -> its functions, in attachment order.
# Copied on write, so a context's dict is never changed under another reader; None when there are none.
_CONTEXT_HOOKS: ContextVar["dict[HookPoint, tuple[HookFn, ...]] | None"] = ContextVar("lenskit_hooks", default=None)


def _fn_name(fn: HookFn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


class HookPoint(nn.Module):
    """Identity on its input, except that attached hook functions see it and may replace it.

    A hook is `fn(tensor, hook) -> None | tensor`; returning a tensor replaces the activation (same shape
    and dtype). Global hooks (`add_hook`) run first, then the calling context's (`HookedRootModule.hooks`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.name: str = ""
        self._fns: list[HookFn] = []

    def add_hook(self, fn: HookFn) -> Callable[[], None]:
        """Attach `fn` globally (every thread sees it); returns a function that removes exactly this attachment.

        Prefer `model.hooks(...)`, whose hooks belong to the calling thread and are removed on exit."""
        self._fns.append(fn)

        def remove() -> None:
            for i, f in enumerate(self._fns):
                if f is fn:
                    del self._fns[i]
                    return

        return remove

    def remove_hooks(self) -> None:
        self._fns.clear()

    def has_hooks(self) -> bool:
        """Whether a global hook or one of the calling context's hooks is attached here."""
        if self._fns:
            return True
        local = _CONTEXT_HOOKS.get()
        return local is not None and self in local

    def hook_fns(self) -> list[HookFn]:
        """The hooks that run here for the calling context: global ones, then the context's."""
        local = _CONTEXT_HOOKS.get()
        return [*self._fns, *local.get(self, ())] if local else list(self._fns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = _CONTEXT_HOOKS.get()
        mine = local.get(self, ()) if local is not None else ()
        if not self._fns:
            if not mine:
                return x  # the no-hook fast path: one context lookup
            fns = mine
        else:
            fns = (*self._fns, *mine)
        for fn in fns:
            out = fn(x, self)
            if out is not None:
                if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise ValueError(f"hook {_fn_name(fn)} on {self.name} returned {got}; "
                                     f"expected a tensor of shape {tuple(x.shape)}")
                if out.dtype != x.dtype:
                    raise TypeError(f"hook {_fn_name(fn)} on {self.name} returned dtype {out.dtype}, but the activation "
                                    f"is {x.dtype}; cast the result with .to({x.dtype})")
                x = out
        return x

    def layer(self) -> int:
        """The block this hook point lives in (`blocks.3.attn.hook_q` -> 3), as in TransformerLens."""
        found = layer_of(self.name)
        if found is None:
            raise ValueError(f"hook point {self.name!r} is not inside a block, so it has no layer")
        return found

    def extra_repr(self) -> str:
        return f"name={self.name!r}, hooks={len(self.hook_fns())}"


class HookedRootModule(nn.Module):
    """A module whose `HookPoint`s are named by their place in the tree. Call `setup_hooks()` last in `__init__`."""

    # Hook points computed only when something is attached to them (they cost extra work).
    ON_REQUEST: tuple[str, ...] = ()

    def setup_hooks(self) -> None:
        self.hook_dict: dict[str, HookPoint] = {}
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name
                self.hook_dict[name] = module

    # ----------------------------------------------------------- name lookup
    def _unknown(self, name: str) -> KeyError:
        close = difflib.get_close_matches(name, list(self.hook_dict), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else "; see model.hook_dict for all names"
        return KeyError(f"unknown hook name {name!r}{hint}")

    def hook_names(self, names_filter: NamesFilter = None) -> list[str]:
        """The hook names a filter selects, in module order (the order of `hook_dict`).

        `None` selects every hook point except those computed only on request (`hook_result`);
        a string or list of strings must name existing hook points; a callable is a predicate.
        """
        if names_filter is None:
            return [n for n in self.hook_dict if not n.endswith(self.ON_REQUEST)] if self.ON_REQUEST else list(self.hook_dict)
        if isinstance(names_filter, str):
            names_filter = [names_filter]
        if callable(names_filter):
            return [n for n in self.hook_dict if names_filter(n)]
        names = list(names_filter)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"names_filter entries must be hook names (str), got {type(n).__name__}")
            if n not in self.hook_dict:
                raise self._unknown(n)
        wanted = set(names)
        return [n for n in self.hook_dict if n in wanted]

    def _resolve(self, name_or_predicate: NameOrPredicate) -> list[HookPoint]:
        if isinstance(name_or_predicate, str):
            if name_or_predicate not in self.hook_dict:
                raise self._unknown(name_or_predicate)
            return [self.hook_dict[name_or_predicate]]
        if callable(name_or_predicate):
            return [hp for n, hp in self.hook_dict.items() if name_or_predicate(n)]
        raise TypeError(f"a hook target must be a hook name or a predicate on names, got {type(name_or_predicate).__name__}")

    # ------------------------------------------------------------- attaching
    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = ()) -> Iterator["HookedRootModule"]:
        """Attach hooks for the body of a `with` block; they are removed on exit, also when it raises.

        >>> with model.hooks([("blocks.0.hook_attn_out", lambda x, hook: x * 0)]):
        ...     logits = model(tokens)

        The hooks belong to the calling thread (its context): another thread running the same model
        meanwhile does not see them.
        """
        added: dict[HookPoint, list[HookFn]] = {}
        for item in fwd_hooks:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"fwd_hooks must hold (hook name or predicate, fn) pairs, got {item!r:.80}")
            target, fn = item
            if not callable(fn):
                raise TypeError(f"hook for {target!r} is not callable: {fn!r}")
            for hp in self._resolve(target):
                added.setdefault(hp, []).append(fn)
        if not added:
            yield self
            return
        merged = dict(_CONTEXT_HOOKS.get() or {})
        for hp, fns in added.items():
            merged[hp] = (*merged.get(hp, ()), *fns)
        token = _CONTEXT_HOOKS.set(merged)
        try:
            yield self
        finally:
            _CONTEXT_HOOKS.reset(token)

    def reset_hooks(self) -> None:
        """Remove every global hook from every hook point, and this context's hooks on this model."""
        for hp in self.hook_dict.values():
            hp.remove_hooks()
        local = _CONTEXT_HOOKS.get()
        if local:
            mine = set(self.hook_dict.values())
            _CONTEXT_HOOKS.set({hp: fns for hp, fns in local.items() if hp not in mine} or None)


def layer_of(name: str) -> int | None:
    """The block index in a hook name (`blocks.3.hook_resid_post` -> 3), or None outside the blocks."""
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) if m else None

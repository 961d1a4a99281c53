"""The calling thread's hooks: lenskit's one context variable.

A `with model.hooks(...)` block, `run_with_hooks` and `run_with_cache` attach hooks for the calling thread only, and
their forward runs through `model(...)`, whose signature has no room for them; so they travel in a `contextvars`
context variable, the only one lenskit has. What it holds is `HookContext`, replaced whole (never edited) on each
change, so a reader never sees another context's hooks and a `finally` puts back exactly what was there:

- `fwd`: hook point -> its forward hooks, in attachment order (`HookedRootModule.hooks`);
- `bwd`: hook point -> its backward hooks' attachments (`lenskit.observe.backward`);
- `recording`: the running `CacheRecording` (lenskit.observe.recording), as (its hook, itself);
- `start`: where the running forward's tokens start under a KV cache, which hooks that name positions read
  (`forward_start`; lenskit.intervene.masks).

Everything else a forward hands its blocks (the KV cache, Gemma 4's per-layer inputs and shared keys) is an argument
of the blocks (lenskit.pieces.forward_state), not context.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, Callable, ContextManager, Iterator, Union

import torch
from torch import nn

# A hook, fn(activation or gradient, hook point) -> None or its replacement. The hook point is a
# lenskit.observe.hooks.HookPoint, named by its base class here: that module imports this one.
HookFn = Callable[[torch.Tensor, nn.Module], Union[torch.Tensor, None]]


class HookContext:
    """One context's hooks (see the module docstring); None where there are none. Never edited: `replace` makes a
    new one."""

    __slots__ = ("fwd", "bwd", "recording", "start")

    def __init__(self, fwd: dict | None = None, bwd: dict | None = None,
                 recording: tuple[HookFn, Any] | None = None, start: int | None = None) -> None:
        self.fwd, self.bwd, self.recording, self.start = fwd, bwd, recording, start

    def replace(self, **changes: Any) -> "HookContext":
        fields = {name: getattr(self, name) for name in self.__slots__}
        return HookContext(**{**fields, **changes})


# The default is never edited (a change replaces the whole HookContext), so sharing it is safe.
HOOK_CONTEXT: ContextVar[HookContext] = ContextVar("lenskit_hook_context", default=HookContext())  # noqa: B039


@contextmanager
def hook_context(**changes: Any) -> Iterator[HookContext]:
    """The calling context's hooks with `changes` for the body of a `with`, put back as they were on exit (also
    when it raises)."""
    token = HOOK_CONTEXT.set(HOOK_CONTEXT.get().replace(**changes))
    try:
        yield HOOK_CONTEXT.get()
    finally:
        HOOK_CONTEXT.reset(token)


def forward_start() -> int | None:
    """The absolute position where the running forward's tokens start: the cache's length in a forward given a
    KVCache, None in a forward without one (its positions are its own, starting at 0)."""
    return HOOK_CONTEXT.get().start


def positions_from(start: int | None) -> ContextManager:
    """What a forward runs its blocks inside so that its hooks read positions from `start` (None: no KV cache).
    Nothing to do, the common case, when neither this forward nor an enclosing one has a cache; a forward without
    one nested in a hook of a cached forward sets None back, since its positions are its own."""
    if start is None and HOOK_CONTEXT.get().start is None:
        return nullcontext()
    return hook_context(start=start)

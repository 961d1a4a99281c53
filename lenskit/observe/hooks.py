"""Hook points: identity modules that name a tensor in the forward pass and let callers read or edit it.

Names come from the module tree (`blocks.3.hook_resid_post`), so nobody types a name twice.
Hooks are temporary: `HookedRootModule.hooks()` removes everything it added in a `finally`.

Hooks added through `hooks()`, `run_with_hooks` or `run_with_cache` belong to the calling thread (its
`contextvars` context): two threads running one model never see each other's hooks. `HookPoint.add_hook`
attaches a global hook instead, seen by every thread until it is removed or `reset_hooks()` runs.

Backward hooks (`bwd_hooks=`, `dir="bwd"`) see the gradient reaching a hook point; see `lenskit.observe.backward`.

`CacheRecording` is what `run_with_cache` attaches: it keeps activations without copies, and while it records,
a hook that is handed a tensor it already holds gets a copy, so an in-place edit never rewrites an earlier entry.
With a host `device`, activations on an accelerator are copied off it as they are written (offload).
"""

from __future__ import annotations

import difflib
import re
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import islice
from typing import Callable, Iterable, Iterator, Sequence, Union

import torch
from torch import nn

from .backward import BACKWARD_HOOKS, Attachment, attach_backward

HookFn = Callable[[torch.Tensor, "HookPoint"], Union[torch.Tensor, None]]
NameOrPredicate = Union[str, Callable[[str], bool]]
NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


# The hooks of the current thread/context: hook point -> its functions, in attachment order.
# Copied on write, so a context's dict is never changed under another reader; None when there are none.
_CONTEXT_HOOKS: ContextVar["dict[HookPoint, tuple[HookFn, ...]] | None"] = ContextVar("lenskit_hooks", default=None)
# The calling context's running CacheRecording, as (its hook, itself), or None.
_RECORDING: ContextVar["tuple[HookFn, CacheRecording] | None"] = ContextVar("lenskit_recording", default=None)


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
        self._bwd: list[Attachment] = []  # global backward hooks

    def add_hook(self, fn: HookFn, dir: str = "fwd") -> Callable[[], None]:
        """Attach `fn` globally (every thread sees it) to the forward (`dir="fwd"`) or backward (`"bwd"`) pass;
        returns a function that removes exactly this attachment.

        Prefer `model.hooks(...)`, whose hooks belong to the calling thread and are removed on exit."""
        if dir == "bwd":
            attachment = Attachment(fn)
            self._bwd.append(attachment)

            def remove_bwd() -> None:
                attachment.live = False
                if attachment in self._bwd:
                    self._bwd.remove(attachment)

            return remove_bwd
        if dir != "fwd":
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        self._fns.append(fn)

        def remove() -> None:
            for i, f in enumerate(self._fns):
                if f is fn:
                    del self._fns[i]
                    return

        return remove

    def remove_hooks(self) -> None:
        """Remove the global hooks, forward and backward."""
        self._fns.clear()
        for attachment in self._bwd:
            attachment.live = False  # also for gradients of a forward that already ran
        self._bwd.clear()

    def has_hooks(self) -> bool:
        """Whether a global hook or one of the calling context's hooks, forward or backward, is attached here
        (pieces compute a point only on request, or take a fused path that skips it, when none is)."""
        if self._fns or self._bwd:
            return True
        local, bwd = _CONTEXT_HOOKS.get(), BACKWARD_HOOKS.get()
        return (local is not None and self in local) or (bwd is not None and self in bwd)

    def hook_fns(self) -> list[HookFn]:
        """The hooks that run here for the calling context: global ones, then the context's."""
        local = _CONTEXT_HOOKS.get()
        return [*self._fns, *local.get(self, ())] if local else list(self._fns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = _CONTEXT_HOOKS.get()
        mine = local.get(self, ()) if local is not None else ()
        if self._fns or mine:
            x = self._run(x, (*self._fns, *mine) if self._fns else mine)
        if self._bwd or BACKWARD_HOOKS.get() is not None:  # without hooks: two context lookups, and x as it came
            x = attach_backward(self, x, self._bwd)  # on the value the forward hooks left
        return x

    def _run(self, x: torch.Tensor, fns: tuple[HookFn, ...]) -> torch.Tensor:
        writer, recording = _RECORDING.get() or (None, None)
        for fn in fns:
            if fn is not writer and recording is not None and recording.holds(x):
                x = x.clone()  # the cache holds x as an earlier point's value: an edit in place here must not reach it
            out = fn(x, self)
            if out is not None:
                x = self._checked(fn, out, x)
        return x

    def _checked(self, fn: HookFn, out: object, x: torch.Tensor) -> torch.Tensor:
        """What hook `fn` returned in place of `x`, refused unless it is a tensor of x's shape, dtype and device."""
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"hook {_fn_name(fn)} on {self.name} returned {got}; "
                             f"expected a tensor of shape {tuple(x.shape)}")
        if out.dtype != x.dtype:
            raise TypeError(f"hook {_fn_name(fn)} on {self.name} returned dtype {out.dtype}, but the activation "
                            f"is {x.dtype}; cast the result with .to({x.dtype})")
        if out.device != x.device:
            raise ValueError(f"hook {_fn_name(fn)} on {self.name} returned a tensor on {out.device}, but the activation "
                             f"is on {x.device}; move the result with .to('{x.device}')")
        return out

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
    def hooks(self, fwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (),
              bwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = ()) -> Iterator["HookedRootModule"]:
        """Attach hooks for the body of a `with` block; they are removed on exit, also when it raises.

        >>> with model.hooks([("blocks.0.hook_attn_out", lambda x, hook: x * 0)]):
        ...     logits = model(tokens)

        `bwd_hooks` see the gradient reaching their point (`lenskit.observe.backward`); call `.backward()`
        inside the block, since after it they no longer run:

        >>> with model.hooks(bwd_hooks=[("blocks.1.hook_resid_post", lambda grad, hook: grad * 0)]):
        ...     model(tokens, return_type="loss").backward()

        The hooks belong to the calling thread (its context): another thread running the same model
        meanwhile does not see them.
        """
        added = self._pairs(fwd_hooks, "fwd_hooks")
        added_bwd = {hp: tuple(map(Attachment, fns)) for hp, fns in self._pairs(bwd_hooks, "bwd_hooks").items()}
        if not added and not added_bwd:
            yield self
            return
        tokens = []
        for var, new in ((_CONTEXT_HOOKS, added), (BACKWARD_HOOKS, added_bwd)):
            if new:
                merged = dict(var.get() or {})
                for hp, fns in new.items():
                    merged[hp] = (*merged.get(hp, ()), *fns)
                tokens.append((var, var.set(merged)))
        try:
            yield self
        finally:
            for attachments in added_bwd.values():
                for a in attachments:
                    a.live = False  # a later backward through this forward's graph calls nothing
            for var, token in reversed(tokens):
                var.reset(token)

    def _pairs(self, items: Iterable[tuple[NameOrPredicate, HookFn]], what: str) -> dict[HookPoint, list[HookFn]]:
        """(name or predicate, fn) pairs as hook point -> fns, refusing unknown names and non-callables."""
        added: dict[HookPoint, list[HookFn]] = {}
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"{what} must hold (hook name or predicate, fn) pairs, got {item!r:.80}")
            target, fn = item
            if not callable(fn):
                raise TypeError(f"hook for {target!r} is not callable: {fn!r}")
            for hp in self._resolve(target):
                added.setdefault(hp, []).append(fn)
        return added

    def reset_hooks(self) -> None:
        """Remove every global hook, forward and backward, from every hook point, and this context's hooks on this model."""
        for hp in self.hook_dict.values():
            hp.remove_hooks()
        mine = set(self.hook_dict.values())
        for attachments in (v for hp, v in (BACKWARD_HOOKS.get() or {}).items() if hp in mine):
            for a in attachments:
                a.live = False
        for var in (_CONTEXT_HOOKS, BACKWARD_HOOKS):
            local = var.get()
            if local:
                var.set({hp: fns for hp, fns in local.items() if hp not in mine} or None)


class CacheRecording:
    """The hook `run_with_cache` attaches to every point it caches, and the activations it kept (`store`).

    Activations are kept as the forward wrote them, detached and without a copy (moved or cast only where
    `device` / `dtype` ask), so one tensor can stand for two points: `resid_post` of block l is `resid_pre` of
    block l + 1, in rotary families `hook_embed` is block 0's `resid_pre`, and after a post-sublayer norm its
    `hook_normalized` is the `hook_attn_out` / `hook_mlp_out` write. While `recording()`, any other hook that
    is handed a tensor sharing memory with an entry gets a copy instead, so its in-place edits (`x[:, 3] = 0`,
    `x.zero_()`) reach that point and the ones after it, never an entry already kept.

    Until such a hook runs, recording costs no more than storing: the entries are looked at only when one is
    about to run (`holds`). The model's own code never edits a tensor in place after it passed a hook point,
    so an entry can change only while a hook runs; `check_unchanged()` then refuses an entry edited some other
    way than through the copy (a hook editing a tensor it kept from an earlier point), found by the entry's
    version counter (`t._version`, bumped by every in-place write).
    """

    def __init__(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        self.store: dict[str, torch.Tensor] = {}
        self._looked_at = 0  # how many entries `holds` has seen
        self._memory: set[int] = set()  # their data pointers
        self._versions: list[tuple[str, torch.Tensor, int]] = []  # (name, entry, version when first seen)
        self._in_flight: set[torch.device] = set()  # accelerators with copies to the host still queued
        store, in_flight = self.store, self._in_flight
        to_host = device is not None and torch.device(device).type == "cpu"
        if device is None and dtype is None:
            def record(x: torch.Tensor, hook: "HookPoint") -> None:
                store[hook.name] = x.detach()
        else:
            def record(x: torch.Tensor, hook: "HookPoint") -> None:  # integer entries (expert indices) keep their dtype
                x = x.detach().to(dtype=dtype if x.is_floating_point() else None)
                if to_host and x.is_cuda:
                    # Offload: a queued copy into pinned host memory, after any cast on the accelerator (only the
                    # kept bytes cross). The forward goes on without waiting; `synchronise` waits once at the end.
                    # A later in-place edit on the device is queued after the copy, so it never reaches the entry.
                    kept = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                    store[hook.name] = kept.copy_(x, non_blocking=True)
                    in_flight.add(x.device)
                else:
                    store[hook.name] = x.to(device=device)
        self.hook: HookFn = record

    def synchronise(self) -> None:
        """Wait for the copies to the host that the hook queued, once per accelerator, so that every entry holds
        its values; a no-op when nothing was offloaded."""
        while self._in_flight:
            torch.cuda.current_stream(self._in_flight.pop()).synchronize()

    def holds(self, x: torch.Tensor) -> bool:
        """Whether `x` shares memory with an entry. Entries kept since the last call are looked at first: their
        memory, and the version of each that spans its whole memory (a part of a buffer, such as hook_q of a
        fused projection, shares its counter with the rest, whose edits would read as its own)."""
        if len(self.store) > self._looked_at:
            for name, kept in islice(self.store.items(), self._looked_at, None):
                self._memory.add(kept.data_ptr())
                spans = kept.storage_offset() == 0 and kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
                if spans and not kept.is_inference():  # inference tensors have no version counter
                    self._versions.append((name, kept, kept._version))
            self._looked_at = len(self.store)
        return x.data_ptr() in self._memory

    @contextmanager
    def recording(self) -> Iterator["CacheRecording"]:
        """Hand other hooks copies of the tensors kept here, for the body of a `with` block."""
        token = _RECORDING.set((self.hook, self))
        try:
            yield self
        finally:
            _RECORDING.reset(token)

    def check_unchanged(self) -> None:
        """Refuse if an entry was edited in place after it was kept, so the cache never holds a later value."""
        for name, kept, version in self._versions:
            if kept._version != version:
                raise ValueError(f"{name} was edited in place after it was cached, by a hook that kept a reference to "
                                 "it, so the cache would not hold what the forward wrote there; edit a copy in the hook "
                                 "instead (x = x.clone(); x[...] = ...; return x)")


def layer_of(name: str) -> int | None:
    """The block index in a hook name (`blocks.3.hook_resid_post` -> 3), or None outside the blocks."""
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) if m else None

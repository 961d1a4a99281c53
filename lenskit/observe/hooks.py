"""Hook points: identity modules that name a tensor in the forward pass and let callers read or edit it.

Names come from the module tree (`blocks.3.hook_resid_post`), so nobody types a name twice.
Hooks are temporary: `HookedRootModule.hooks()` removes everything it added in a `finally`.

Hooks added through `hooks()`, `run_with_hooks` or `run_with_cache` belong to the calling thread (its
`contextvars` context): two threads running one model never see each other's hooks. `add_hook` attaches a global
hook instead, seen by every thread until it is removed or `reset_hooks()` runs; a permanent one (`add_perma_hook`)
stays through `reset_hooks()` too, unless that is called with `including_permanent=True`, as in TransformerLens.

Backward hooks (`bwd_hooks=`, `dir="bwd"`) see the gradient reaching a hook point; see `lenskit.observe.backward`.
`CacheRecording` (lenskit.observe.recording) is what `run_with_cache` attaches. The calling context's hooks live in
lenskit's one context variable (lenskit.observe.hook_context).

`HookedRootModule` is whole here, with TransformerLens's administration (`add_hook`, `run_with_hooks`,
`run_with_cache`, `reset_hooks` ...), so code written against `transformer_lens.hook_points.HookedRootModule` (an SAE
that builds HookPoints, calls `self.setup()`, then `run_with_hooks` / `run_with_cache`) runs on lenskit's.
`lenskit.HookedTransformer` has its own richer `run_with_hooks` / `run_with_cache`, with the same hook semantics.

>>> class Doubler(HookedRootModule):
...     def __init__(self):
...         super().__init__()
...         self.hook_in = HookPoint()    # [batch, d]
...         self.setup()
...     def forward(self, x):
...         return 2 * self.hook_in(x)
>>> out, cache = Doubler().run_with_cache(torch.ones(1, 3))
>>> out, cache["hook_in"]
(tensor([[2., 2., 2.]]), tensor([[1., 1., 1.]]))
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence, Union

import torch
from torch import nn

from ..suggest import hook_hint
from .backward import Attachment, attach_backward, backward_from, check_gradients_possible
from .hook_context import HOOK_CONTEXT
from .recording import CacheRecording  # noqa: F401  (CacheRecording: imported from here too)

HookFn = Callable[[torch.Tensor, "HookPoint"], Union[torch.Tensor, None]]
NameOrPredicate = Union[str, Callable[[str], bool]]
NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
HookPairs = Iterable["tuple[NameOrPredicate, HookFn]"]


def _fn_name(fn: HookFn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


class LensHandle:
    """One global hook attached to one hook point (TransformerLens's `LensHandle`): `remove()` (or calling it)
    detaches exactly this attachment. `is_permanent` hooks survive `reset_hooks()` unless it is asked to remove
    them; `context_level` is the `level` it was attached with."""

    __slots__ = ("point", "user_hook", "dir", "is_permanent", "context_level", "attachment", "scoped")

    def __init__(self, point: "HookPoint", fn: HookFn, dir: str, is_permanent: bool, level: int | None,
                 scoped: bool = False) -> None:
        self.point, self.user_hook, self.dir = point, fn, dir
        self.is_permanent, self.context_level = is_permanent, level
        self.attachment = Attachment(fn) if dir == "bwd" and not scoped else None
        self.scoped = scoped  # a view of a hook from the calling context's `hooks()` block, not a global attachment

    @property
    def hook(self) -> "LensHandle":
        """Itself, so TransformerLens's `handle.hook.remove()` works."""
        return self

    def matches(self, including_permanent: bool, level: int | None) -> bool:
        return (including_permanent or not self.is_permanent) and (level is None or self.context_level == level)

    def remove(self) -> None:
        self.point._detach(self)

    __call__ = remove


class HookPoint(nn.Module):
    """Identity on its input, except that attached hook functions see it and may replace it.

    A hook is `fn(tensor, hook) -> None | tensor`; returning a tensor replaces the activation (same shape
    and dtype). Global hooks (`add_hook`) run first, then the calling context's (`HookedRootModule.hooks`).
    `ctx` is a dict a hook may keep state in (TransformerLens's), emptied by `reset_hooks(clear_contexts=True)`.
    """

    def __init__(self, integer: bool = False) -> None:
        super().__init__()
        self.name: str = ""
        self.integer = integer  # it carries integers (a MoE's expert indices): no gradient reaches it
        self.ctx: dict = {}
        self._fwd_handles: list[LensHandle] = []  # global forward hooks, in running order
        self._bwd_handles: list[LensHandle] = []
        self._fns: tuple[HookFn, ...] = ()  # the forward hooks' functions, read on every forward
        self._bwd: list[Attachment] = []  # the backward hooks' attachments

    @property
    def fwd_hooks(self) -> list[LensHandle]:
        """The forward hooks that run here for the calling context, in running order: the global ones, then those of
        the calling context's `hooks()` blocks (whose handles `hooks()` removes on exit)."""
        local = HOOK_CONTEXT.get().fwd
        mine = local.get(self, ()) if local is not None else ()
        return [*self._fwd_handles, *(LensHandle(self, fn, "fwd", False, None, scoped=True) for fn in mine)]

    @property
    def bwd_hooks(self) -> list[LensHandle]:
        """The backward hooks for the calling context: the global ones, then those of its `hooks()` blocks."""
        local = HOOK_CONTEXT.get().bwd
        mine = [a for a in (local.get(self, ()) if local is not None else ()) if a.live]
        return [*self._bwd_handles, *(LensHandle(self, a.fn, "bwd", False, None, scoped=True) for a in mine)]

    def add_hook(self, fn: HookFn, dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
                 prepend: bool = False) -> LensHandle:
        """Attach `fn` globally (every thread sees it) to the forward (`dir="fwd"`) or backward (`"bwd"`) pass,
        after the hooks already there (before them with `prepend`); returns its handle (`handle()` removes it).

        Prefer `model.hooks(...)`, whose hooks belong to the calling thread and are removed on exit."""
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        if not callable(fn):
            raise TypeError(f"hook for {self.name!r} is not callable: {fn!r}")
        if dir == "bwd":
            self.check_backward()
        handle = LensHandle(self, fn, dir, is_permanent, level)
        handles = self._fwd_handles if dir == "fwd" else self._bwd_handles
        handles.insert(0, handle) if prepend else handles.append(handle)
        self._sync()
        return handle

    def check_backward(self) -> None:
        """ValueError if a backward hook here could never run: an integer hook point has no gradient."""
        if self.integer:
            raise ValueError(f"{self.name} carries integers, which have no gradient, so a backward hook there never "
                             "runs; hook a float point beside it (such as the block's hook_expert_weights)")

    def add_perma_hook(self, fn: HookFn, dir: str = "fwd") -> LensHandle:
        """`add_hook(fn, dir, is_permanent=True)`: kept by `reset_hooks()` unless `including_permanent=True`."""
        return self.add_hook(fn, dir=dir, is_permanent=True)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, level: int | None = None) -> None:
        """Remove the global hooks of `dir` ("fwd", "bwd" or "both") that are not permanent (all of them with
        `including_permanent`), only those attached with `level` where it is given, as TransformerLens does."""
        dirs = _directions(dir)
        for handle in [*self._fwd_handles, *self._bwd_handles]:
            if handle.dir in dirs and handle.matches(including_permanent, level):
                self._detach(handle)

    def _detach(self, handle: LensHandle) -> None:
        if handle.scoped:
            raise ValueError(f"this hook on {self.name} belongs to a `with model.hooks(...)` block (or run_with_hooks), "
                             "which removes it on exit; it cannot be removed on its own")
        handles = self._fwd_handles if handle.dir == "fwd" else self._bwd_handles
        if handle in handles:
            handles.remove(handle)
        if handle.attachment is not None:
            handle.attachment.live = False  # also for gradients of a forward that already ran
        self._sync()

    def _sync(self) -> None:
        self._fns = tuple(h.user_hook for h in self._fwd_handles)
        self._bwd = [h.attachment for h in self._bwd_handles]

    def clear_context(self) -> None:
        self.ctx = {}

    def has_hooks(self, dir: str = "both", including_permanent: bool = True, level: int | None = None) -> bool:
        """Whether a hook of `dir` ("fwd", "bwd", "both") is attached here: a global one, or one of the calling
        context's (pieces compute a point only on request, or take a fused path that skips it, when none is).
        With `including_permanent=False` permanent hooks do not count; with `level`, only global hooks attached
        with that level do."""
        if dir == "both" and including_permanent and level is None:  # the forward's question: kept cheap
            if self._fns or self._bwd:
                return True
            context = HOOK_CONTEXT.get()
            local, bwd = context.fwd, context.bwd
            return (local is not None and self in local) or (bwd is not None and self in bwd)
        dirs = _directions(dir)
        if any(h.dir in dirs and h.matches(including_permanent, level) for h in [*self._fwd_handles, *self._bwd_handles]):
            return True
        context = HOOK_CONTEXT.get()
        contexts = [local for d, local in (("fwd", context.fwd), ("bwd", context.bwd)) if d in dirs]
        return level is None and any(local is not None and self in local for local in contexts)

    def hook_fns(self) -> list[HookFn]:
        """The hooks that run here for the calling context: global ones, then the context's."""
        local = HOOK_CONTEXT.get().fwd
        return [*self._fns, *local.get(self, ())] if local else list(self._fns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = HOOK_CONTEXT.get()
        local = context.fwd
        mine = local.get(self, ()) if local is not None else ()
        if self._fns or mine:
            x = self._run(x, (*self._fns, *mine) if self._fns else mine, context.recording)
        if self._bwd or context.bwd is not None:  # without hooks: one context lookup, and x as it came
            x = attach_backward(self, x, self._bwd, context.bwd)  # on the value the forward hooks left
        return x

    def _run(self, x: torch.Tensor, fns: tuple[HookFn, ...], recorder: tuple | None) -> torch.Tensor:
        writer, recording = recorder or (None, None)
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
    """A module whose `HookPoint`s are named by their place in the tree. Call `setup()` (or its other name,
    `setup_hooks()`) last in `__init__`, and again after adding hook points. With TransformerLens's administration
    (`add_hook`, `run_with_hooks`, `run_with_cache` ...) for any subclass."""

    # Hook points computed only when something is attached to them (they cost extra work).
    ON_REQUEST: tuple[str, ...] = ()
    context_level = 0  # how many `hooks()` blocks are open (TransformerLens's `level` of hooks they attach globally)

    def __init__(self, *args: object) -> None:
        super().__init__()  # arguments ignored, as TransformerLens's own takes and ignores them (subclasses pass cfg)

    def setup_hooks(self) -> None:
        """Name every hook point by its path and build `hook_dict` (name -> HookPoint) and `mod_dict` (name ->
        every submodule)."""
        self.hook_dict: dict[str, HookPoint] = {}
        self.mod_dict: dict[str, nn.Module] = {}
        for name, module in self.named_modules():
            if not name:
                continue
            self.mod_dict[name] = module
            if isinstance(module, HookPoint):
                module.name = name
                self.hook_dict[name] = module

    setup = setup_hooks  # TransformerLens's name

    # ----------------------------------------------------------- name lookup
    def _unknown(self, name: str) -> KeyError:
        return KeyError(f"unknown hook name {name!r}{hook_hint(name, self.hook_dict)}")

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
              bwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (), reset_hooks_end: bool = True,
              clear_contexts: bool = False) -> Iterator["HookedRootModule"]:
        """Attach hooks for the body of a `with` block; they are removed on exit, also when it raises.

        >>> with model.hooks([("blocks.0.hook_attn_out", lambda x, hook: x * 0)]):
        ...     logits = model(tokens)

        `bwd_hooks` see the gradient reaching their point (`lenskit.observe.backward`); call `.backward()`
        inside the block, since after it they no longer run:

        >>> with model.hooks(bwd_hooks=[("blocks.1.hook_resid_post", lambda grad, hook: grad * 0)]):
        ...     model(tokens, return_type="loss").backward()

        The hooks belong to the calling thread (its context): another thread running the same model
        meanwhile does not see them. With `reset_hooks_end=False` they are attached globally instead
        (`add_hook`, with this block's level) and stay after it, as in TransformerLens. `clear_contexts` empties
        every hook point's `ctx` on exit.
        """
        added = self._pairs(fwd_hooks, "fwd_hooks")
        added_bwd = self._pairs(bwd_hooks, "bwd_hooks")
        if added_bwd:
            check_gradients_possible("a backward hook")
        self.context_level += 1
        token, attachments = None, {}
        try:
            if not reset_hooks_end:
                for dir, new in (("fwd", added), ("bwd", added_bwd)):
                    for hp, fns in new.items():
                        for fn in fns:
                            hp.add_hook(fn, dir=dir, level=self.context_level)
                added, added_bwd = {}, {}
            attachments = {hp: tuple(map(Attachment, fns)) for hp, fns in added_bwd.items()}
            if added or attachments:  # the calling context's hooks, with these after those already there
                context = HOOK_CONTEXT.get()
                token = HOOK_CONTEXT.set(context.replace(fwd=_merged(context.fwd, added),
                                                         bwd=_merged(context.bwd, attachments)))
            yield self
        finally:
            for attached in attachments.values():
                for a in attached:
                    a.live = False  # a later backward through this forward's graph calls nothing
            if token is not None:
                HOOK_CONTEXT.reset(token)
            self.context_level -= 1
            if clear_contexts:
                self.clear_contexts()

    def _pairs(self, items: Iterable[tuple[NameOrPredicate, HookFn]], what: str) -> dict[HookPoint, list[HookFn]]:
        """(name or predicate, fn) pairs as hook point -> fns, refusing unknown names and non-callables."""
        added: dict[HookPoint, list[HookFn]] = {}
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"{what} must hold (hook name or predicate, fn) pairs, got {item!r:.80}")
            target, fn = item
            if not callable(fn):
                raise TypeError(f"hook for {target!r} is not callable: {fn!r}")
            points = self._resolve(target)
            if what == "bwd_hooks":  # a predicate passes over integer points, where no gradient arrives; a name is refused
                for hp in points if isinstance(target, str) else ():
                    hp.check_backward()
                points = [hp for hp in points if not hp.integer]
            for hp in points:
                added.setdefault(hp, []).append(fn)
        return added

    def remove_all_hook_fns(self, direction: str = "both", including_permanent: bool = False,
                            level: int | None = None) -> None:
        """Remove the hooks of `direction` ("fwd", "bwd", "both"): the global ones that are not permanent (all with
        `including_permanent`; with `level`, only those attached with it), and, unless `level` is given, the calling
        context's hooks on this model (those of open `hooks()` blocks, `run_with_hooks` and `run_with_cache`)."""
        dirs = _directions(direction)
        for hp in self.hook_dict.values():
            hp.remove_hooks(direction, including_permanent=including_permanent, level=level)
        if level is not None:
            return
        mine = set(self.hook_dict.values())
        context = HOOK_CONTEXT.get()
        if "bwd" in dirs:
            for attachments in (v for hp, v in (context.bwd or {}).items() if hp in mine):
                for a in attachments:
                    a.live = False
        kept = {d: {hp: fns for hp, fns in (local or {}).items() if hp not in mine} or None if d in dirs else local
                for d, local in (("fwd", context.fwd), ("bwd", context.bwd))}
        if kept["fwd"] is not context.fwd or kept["bwd"] is not context.bwd:
            HOOK_CONTEXT.set(context.replace(**kept))  # until the `hooks()` block that set them exits

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False,
                    level: int | None = None) -> None:
        """TransformerLens's reset: empty every hook point's `ctx` (with `clear_contexts`), then
        `remove_all_hook_fns(direction, including_permanent, level)`. Permanent hooks (`add_perma_hook`) stay
        unless `including_permanent=True`."""
        if clear_contexts:
            self.clear_contexts()
        self.remove_all_hook_fns(direction, including_permanent, level)

    def clear_contexts(self) -> None:
        """Empty every hook point's `ctx`."""
        for hp in self.hook_dict.values():
            hp.clear_context()

    # ------------------------------------------- TransformerLens's administration
    def hook_points(self) -> Iterable[HookPoint]:
        """Every hook point, in module order."""
        return self.hook_dict.values()

    def add_hook(self, name: NameOrPredicate, hook: HookFn, dir: str = "fwd", is_permanent: bool = False,
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

    def add_perma_hook(self, name: NameOrPredicate, hook: HookFn, dir: str = "fwd") -> None:
        """`add_hook(name, hook, dir, is_permanent=True)`."""
        self.add_hook(name, hook, dir=dir, is_permanent=True)

    def run_with_hooks(self, *model_args: Any, fwd_hooks: HookPairs = (), bwd_hooks: HookPairs = (),
                       reset_hooks_end: bool = True, clear_contexts: bool = False, **model_kwargs: Any) -> Any:
        """The forward on `model_args` / `model_kwargs` with the hooks attached for this call (with
        `reset_hooks_end=False`, attached globally and left there, which backward hooks need: they run only when
        `.backward()` is called after the forward)."""
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
            return self(*model_args, **model_kwargs)

    def run_with_cache(self, *model_args: Any, names_filter: NamesFilter = None, device: str | torch.device | None = None,
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

    def get_caching_hooks(self, names_filter: NamesFilter = None, incl_bwd: bool = False,
                          device: str | torch.device | None = None, remove_batch_dim: bool = False,
                          cache: dict | None = None) -> tuple[dict, list, list]:
        """(cache, fwd_hooks, bwd_hooks): hooks that write into `cache` (a new dict unless given), not attached."""
        cache = {} if cache is None else cache

        def keeper(suffix: str) -> Callable[[torch.Tensor, HookPoint], None]:
            def keep(x: torch.Tensor, hook: HookPoint) -> None:
                x = x.detach().to(device)
                cache[hook.name + suffix] = x.squeeze(0) if remove_batch_dim and x.ndim > 0 and x.shape[0] == 1 else x
            return keep

        names = self.hook_names(names_filter)
        fwd = [(name, keeper("")) for name in names]
        bwd = [(name, keeper("_grad")) for name in names] if incl_bwd else []
        return cache, fwd, bwd


def _merged(local: dict | None, new: dict) -> dict | None:
    """A context's hook point -> hooks with `new`'s after its own: a new dict (a context's is never edited)."""
    if not new:
        return local
    merged = dict(local or {})
    for hp, fns in new.items():
        merged[hp] = (*merged.get(hp, ()), *fns)
    return merged


def _directions(direction: str) -> tuple[str, ...]:
    """"fwd", "bwd" or "both" as the directions it names; anything else refused."""
    if direction not in ("fwd", "bwd", "both"):
        raise ValueError(f"direction must be 'fwd', 'bwd' or 'both', got {direction!r}")
    return ("fwd", "bwd") if direction == "both" else (direction,)


def layer_of(name: str) -> int | None:
    """The block index in a hook name (`blocks.3.hook_resid_post` -> 3), or None outside the blocks."""
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) if m else None
